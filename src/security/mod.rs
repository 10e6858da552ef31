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

/// Implements `Deserialize` for the public struct `$t` from a map (a TOML table, a JSON object)
/// only, through `$def`, a private mirror of it that derives `Deserialize` with
/// `#[serde(remote = "$t")]`. Serde's derive also reads a struct from a sequence, field by
/// field in order, so a token's `"permissions":[{"allow":[">"]}]` would read as a publish rule
/// and `"limits":[1]` as `max_connections`; such a shape is refused, naming what was expected.
/// (The mirror is private, so no public reader of the struct accepts a sequence.)
macro_rules! deserialize_from_map_only {
    ($t:ty, $def:ty) => {
        impl<'de> serde::Deserialize<'de> for $t {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct MapOnly;
                impl<'de> serde::de::Visitor<'de> for MapOnly {
                    type Value = $t;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("a table of named fields (a JSON object)")
                    }
                    fn visit_map<A: serde::de::MapAccess<'de>>(
                        self,
                        map: A,
                    ) -> Result<$t, A::Error> {
                        <$def>::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                    }
                }
                d.deserialize_map(MapOnly)
            }
        }
    };
}
pub(crate) use deserialize_from_map_only;
