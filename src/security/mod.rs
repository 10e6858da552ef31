//! Who may connect, and what they may do: the building blocks of authentication, per-stream
//! permissions and TLS.
//!
//! **Not enforced yet**: `powerhub serve` reads no `[auth]` section and no TLS keys, and every
//! connection may still do everything. These modules are the sans-IO pieces the server will be
//! wired to (see `docs/security.md`):
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
