//! Who may connect, and what they may do: authentication, per-stream permissions and TLS.
//!
//! `powerhub serve` enforces [`auth`] and [`permissions`] once its config has an `[auth]`
//! section: the push [`Session`](crate::protocol::Session) verifies the `auth` command (or the
//! WebSocket handshake's token) and checks every subscribe and publish; a listener with
//! `tls_cert` and `tls_key` speaks TLS through [`tls`]'s session, driven by the shard that owns
//! the connection. See `docs/security.md`. The modules are sans-IO:
//!
//! - [`auth`]: the `[auth]` configuration, and the [`auth::Authenticator`] that verifies a static
//!   token or a JWT at a given `now` into an [`auth::Identity`], or refuses it with a named
//!   [`auth::AuthError`].
//! - [`permissions`]: allow and deny patterns over `stream` and `stream/device` for publish and
//!   subscribe, system streams (`$…`), and a per-connection cache of publish decisions.
//! - [`tls`]: a rustls server configuration from a listener's PEM files, and a sans-IO TLS
//!   session a shard feeds with socket bytes.

pub mod auth;
pub mod permissions;
pub mod tls;
