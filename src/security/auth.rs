//! Who a client is: the `[auth]` configuration and the [`Authenticator`] that turns a presented
//! token into an [`Identity`] or a named [`AuthError`].
//!
//! Two kinds of credentials, either or both:
//!
//! - **Static tokens** (`[[auth.tokens]]`): an opaque string, the user it stands for and that
//!   user's [`PermissionsConfig`]. A presented token is hashed (SHA-256) and compared with every
//!   configured token's digest in constant time, all of them every time.
//! - **JWTs** (`[auth.jwt]`): one algorithm per server (`HS256` with a shared secret, `RS256` or
//!   `ES256` with a public key in a PEM file); the claims `sub` (the user, required), `exp` and
//!   `nbf` (checked against the caller's `now`, with `leeway_secs`), `aud` and `iss` (checked
//!   when configured; a token naming an audience is refused by a server that names none, as
//!   RFC 7519 §4.1.3 says), and the user's permissions in a claim (`permissions` by default) of
//!   the same shape as a static token's.
//!
//! Verification is sans-IO: [`Authenticator::verify`] takes `now`, so expiry is tested on a
//! virtual clock; key files are read when the authenticator is built
//! ([`Authenticator::from_config`], or [`Authenticator::from_config_with`] with a reader of the
//! caller's).
//!
//! ```
//! use std::time::{Duration, UNIX_EPOCH};
//! use powerhub::security::auth::{AuthConfig, AuthError, Authenticator};
//!
//! let config: AuthConfig = toml::from_str(r#"
//!     [[tokens]]
//!     token = "s3cr3t-token-for-the-dashboard"
//!     user = "dashboard"
//!     permissions = { subscribe = { allow = [">", "$stats"] } }
//!
//!     [jwt]
//!     algorithm = "HS256"
//!     secret = "a shared secret of at least thirty-two bytes"
//!     audience = "powerhub"
//! "#).unwrap();
//! let auth = Authenticator::from_config(&config).unwrap();
//! let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
//!
//! let who = auth.verify("s3cr3t-token-for-the-dashboard", now).unwrap();
//! assert_eq!(who.user, "dashboard");
//! assert!(who.permissions.subscribe("$stats", None).is_allowed());
//!
//! // A JWT, as an identity provider would issue it.
//! let claims = serde_json::json!({
//!     "sub": "alice", "aud": "powerhub", "exp": 1_700_000_060,
//!     "permissions": { "publish": { "allow": ["obs/>"] } },
//! });
//! let jwt = jsonwebtoken::encode(
//!     &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
//!     &claims,
//!     &jsonwebtoken::EncodingKey::from_secret(b"a shared secret of at least thirty-two bytes"),
//! ).unwrap();
//! let alice = auth.verify(&jwt, now).unwrap();
//! assert_eq!(alice.user, "alice");
//! assert!(alice.permissions.publish("obs", Some("dev1")).is_allowed());
//! assert_eq!(alice.expires_at, Some(UNIX_EPOCH + Duration::from_secs(1_700_000_060)));
//!
//! let later = UNIX_EPOCH + Duration::from_secs(1_700_000_060);
//! let err = auth.verify(&jwt, later).unwrap_err();
//! assert_eq!(err, AuthError::Expired { exp: 1_700_000_060 });
//! assert_eq!(err.code(), "token_expired");
//! ```

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use jsonwebtoken::errors::ErrorKind as JwtErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, SubjectPublicKeyInfoDer};
use serde::Deserialize;
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use subtle::{ConditionallySelectable, ConstantTimeEq};

use super::permissions::{PatternError, Permissions, PermissionsConfig};
use super::tls::PeerSubject;
use powerhub_plugin::codes;

/// The longest token [`Authenticator::verify`] reads; a longer one is [`AuthError::Malformed`].
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// The shortest HS256 secret accepted: the size of the hash output (RFC 7518 §3.2).
pub const MIN_HS256_SECRET_BYTES: usize = 32;

/// The largest `[auth.jwt] leeway_secs` accepted: a day of clock skew.
pub const MAX_LEEWAY_SECS: u64 = 86_400;

/// The smallest RSA modulus accepted for RS256, in bits (RFC 7518 §3.3).
pub const MIN_RSA_BITS: usize = 2048;

/// The JWT claim that may give the user publish rates of its own
/// (`{"publish_messages_per_second":50}`, the shape of [`UserRates`]).
pub const RATES_CLAIM: &str = "rates";

/// The JWT claim that may give the user connection and subscription limits of its own
/// (`{"max_connections":2}`, the shape of [`UserLimits`]).
pub const LIMITS_CLAIM: &str = "limits";

/// The `permissions_claim` when none is configured.
pub const DEFAULT_PERMISSIONS_CLAIM: &str = "permissions";

/// The `[auth]` section. Authentication is on as soon as this section is present; it must then
/// configure at least one static token, a `[auth.jwt]` section, or `[[auth.certificates]]` (which
/// the server's configuration accepts only with a listener that asks for client certificates).
///
/// `Debug` leaves tokens and secrets out.
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Static tokens (`[[auth.tokens]]`).
    #[serde(default)]
    pub tokens: Vec<StaticTokenConfig>,
    /// JWT verification (`[auth.jwt]`).
    #[serde(default)]
    pub jwt: Option<JwtConfig>,
    /// Client certificates that authenticate by themselves (`[[auth.certificates]]`), on a
    /// listener with `tls_client_ca` (mutual TLS).
    #[serde(default)]
    pub certificates: Vec<CertificateUserConfig>,
    /// Whether a published message may have the `type` of one of the server's own messages
    /// (`error`, `pong`, `subscribed`, `frames_dropped`, ... : see
    /// [`RESERVED_MESSAGE_TYPES`](crate::protocol::RESERVED_MESSAGE_TYPES)). Default `false`:
    /// such a publish is refused with `reserved_type`, so that what a subscriber reads with a
    /// server reply's type came from the server. (While authentication is off every publisher
    /// is trusted, and such messages are forwarded like any other.)
    #[serde(default)]
    pub allow_reply_types: bool,
    /// Most connections one user may hold authenticated at a time; the next one is closed with
    /// a `limit_exceeded` error naming this key. 0 (the default): no limit.
    #[serde(default)]
    pub max_connections_per_user: usize,
    /// Most subscriptions one user may hold across its connections; the next subscribe gets a
    /// `limit_exceeded` error naming this key (the connection stays). 0 (the default): no limit.
    #[serde(default)]
    pub max_subscriptions_per_user: usize,
    /// Most messages one user may publish per second, summed over its connections on every
    /// shard (a token bucket of one second's worth); a publish past it gets a
    /// `limit_exceeded` error naming this key, as the per-connection
    /// `limits.publish_messages_per_second`, and counts towards
    /// `limits.publish_violations_before_close`. 0 (the default): no limit.
    #[serde(default)]
    pub publish_messages_per_second_per_user: u64,
    /// Most bytes of messages one user may publish per second, summed over its connections, as
    /// [`AuthConfig::publish_messages_per_second_per_user`]. 0 (the default): no limit.
    #[serde(default)]
    pub publish_bytes_per_second_per_user: u64,
}

impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("tokens", &self.tokens)
            .field("jwt", &self.jwt)
            .field("certificates", &self.certificates)
            .field("allow_reply_types", &self.allow_reply_types)
            .field("max_connections_per_user", &self.max_connections_per_user)
            .field(
                "max_subscriptions_per_user",
                &self.max_subscriptions_per_user,
            )
            .field(
                "publish_messages_per_second_per_user",
                &self.publish_messages_per_second_per_user,
            )
            .field(
                "publish_bytes_per_second_per_user",
                &self.publish_bytes_per_second_per_user,
            )
            .finish()
    }
}

/// One `[[auth.tokens]]` entry. `Debug` leaves the token out.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticTokenConfig {
    /// The secret string the client presents. Non-empty; each token at most once.
    pub token: String,
    /// The user it authenticates as. Non-empty.
    pub user: String,
    /// What that user may do (default: nothing).
    #[serde(default)]
    pub permissions: PermissionsConfig,
    /// The user's own publish rates (default: the `[auth]` per-user ones), e.g.
    /// `rates = { publish_messages_per_second = 50 }`.
    #[serde(default)]
    pub rates: UserRates,
    /// The user's own connection and subscription limits (default: the `[auth]` per-user
    /// ones), e.g. `limits = { max_connections = 2, max_subscriptions = 20 }`.
    #[serde(default)]
    pub limits: UserLimits,
}

impl fmt::Debug for StaticTokenConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StaticTokenConfig")
            .field("token", &"<redacted>")
            .field("user", &self.user)
            .field("permissions", &self.permissions)
            .field("rates", &self.rates)
            .field("limits", &self.limits)
            .finish()
    }
}

/// One `[[auth.certificates]]` entry: a client certificate, known by its subject, that
/// authenticates its connection as `user` once the TLS handshake verified it against the
/// listener's `tls_client_ca`, with no token (as NATS's `verify_and_map`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertificateUserConfig {
    /// The certificate's subject as an RFC 4514 string, most specific part first, compared
    /// exactly: `CN=alice,O=Example` (what `openssl x509 -noout -subject -nameopt RFC2253`
    /// prints). Non-empty; each subject at most once.
    pub subject: String,
    /// The user it authenticates as; default: the subject's common name (`CN`), or the whole
    /// subject when it has none.
    #[serde(default)]
    pub user: Option<String>,
    /// What that user may do (default: nothing).
    #[serde(default)]
    pub permissions: PermissionsConfig,
    /// The user's own publish rates (default: the `[auth]` per-user ones).
    #[serde(default)]
    pub rates: UserRates,
    /// The user's own connection and subscription limits (default: the `[auth]` per-user
    /// ones).
    #[serde(default)]
    pub limits: UserLimits,
}

/// A JWT signature algorithm the server can be configured to accept (exactly one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
pub enum JwtAlgorithm {
    /// HMAC with SHA-256 and a shared secret.
    #[serde(rename = "HS256")]
    Hs256,
    /// RSASSA-PKCS1-v1_5 with SHA-256 and an RSA public key.
    #[serde(rename = "RS256")]
    Rs256,
    /// ECDSA on P-256 with SHA-256 and an EC public key.
    #[serde(rename = "ES256")]
    Es256,
}

impl JwtAlgorithm {
    /// The name as it appears in the JWT header's `alg` (`HS256`).
    pub fn as_str(self) -> &'static str {
        match self {
            JwtAlgorithm::Hs256 => "HS256",
            JwtAlgorithm::Rs256 => "RS256",
            JwtAlgorithm::Es256 => "ES256",
        }
    }

    fn jsonwebtoken(self) -> Algorithm {
        match self {
            JwtAlgorithm::Hs256 => Algorithm::HS256,
            JwtAlgorithm::Rs256 => Algorithm::RS256,
            JwtAlgorithm::Es256 => Algorithm::ES256,
        }
    }
}

impl fmt::Display for JwtAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[auth.jwt]` section. `Debug` leaves the secret out.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JwtConfig {
    /// The one algorithm accepted; a token whose header names another is refused.
    pub algorithm: JwtAlgorithm,
    /// HS256: the shared secret, inline (at least [`MIN_HS256_SECRET_BYTES`] bytes).
    #[serde(default)]
    pub secret: Option<String>,
    /// HS256: a file holding the shared secret (a trailing line break is not part of it).
    #[serde(default)]
    pub secret_file: Option<PathBuf>,
    /// RS256 and ES256: a PEM file with the public key (`PUBLIC KEY`) or a certificate
    /// (`CERTIFICATE`) carrying it.
    #[serde(default)]
    pub public_key_file: Option<PathBuf>,
    /// When set, a token's `aud` (a string or an array of strings) must contain this value.
    #[serde(default)]
    pub audience: Option<String>,
    /// When set, a token's `iss` must be this value.
    #[serde(default)]
    pub issuer: Option<String>,
    /// The claim holding the user's permissions (default [`DEFAULT_PERMISSIONS_CLAIM`]). A token
    /// without it authenticates with no permissions.
    #[serde(default = "default_permissions_claim")]
    pub permissions_claim: String,
    /// Seconds of clock skew tolerated on `exp` and `nbf` (default 0, at most
    /// [`MAX_LEEWAY_SECS`]).
    #[serde(default)]
    pub leeway_secs: u64,
    /// When true, a JWT without `exp` is refused ([`AuthError::MissingExp`]), so that every JWT
    /// expires (static tokens never do). Default false: a JWT without `exp` never expires, as
    /// in NATS.
    #[serde(default)]
    pub require_exp: bool,
}

fn default_permissions_claim() -> String {
    DEFAULT_PERMISSIONS_CLAIM.to_owned()
}

impl fmt::Debug for JwtConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JwtConfig")
            .field("algorithm", &self.algorithm)
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("secret_file", &self.secret_file)
            .field("public_key_file", &self.public_key_file)
            .field("audience", &self.audience)
            .field("issuer", &self.issuer)
            .field("permissions_claim", &self.permissions_claim)
            .field("leeway_secs", &self.leeway_secs)
            .field("require_exp", &self.require_exp)
            .finish()
    }
}

/// Why an `[auth]` section could not be turned into an [`Authenticator`]. Each variant names the
/// key, entry or file at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AuthConfigError {
    /// `[auth]` is present but configures no token, JWT key or certificate: nobody could
    /// connect.
    #[error(
        "[auth] configures no credentials: add [[auth.tokens]] entries, an [auth.jwt] section \
         or [[auth.certificates]] entries"
    )]
    NoCredentials,
    /// A `[[auth.certificates]]` entry is unusable: an empty subject or user, a subject listed
    /// twice, or an invalid permission pattern.
    #[error("auth.certificates[{index}]: {reason}")]
    Certificate {
        /// The entry's position in `[[auth.certificates]]`, from 0.
        index: usize,
        /// What is wrong.
        reason: String,
    },
    /// A static token or its user is empty.
    #[error("auth.tokens[{index}].{key} must not be empty")]
    Empty {
        /// The entry's position in `[[auth.tokens]]`, from 0.
        index: usize,
        /// `token` or `user`.
        key: &'static str,
    },
    /// A static token is longer than any token a client may present ([`MAX_TOKEN_BYTES`]), so
    /// it could never authenticate.
    #[error("auth.tokens[{index}].token is {len} bytes, over the {MAX_TOKEN_BYTES} bytes a presented token may have")]
    TokenTooLong {
        /// The entry's position in `[[auth.tokens]]`, from 0.
        index: usize,
        /// The token's length in bytes.
        len: usize,
    },
    /// The same token is configured twice.
    #[error("auth.tokens[{index}].token repeats auth.tokens[{first}].token")]
    DuplicateToken {
        /// The repeat.
        index: usize,
        /// The first entry with that token.
        first: usize,
    },
    /// A static token's permissions hold an invalid pattern.
    #[error("auth.tokens[{index}] (user `{user}`): {source}")]
    Permissions {
        /// The entry.
        index: usize,
        /// Its user.
        user: String,
        /// The pattern and what is wrong with it.
        source: PatternError,
    },
    /// The algorithm's key is not configured.
    #[error("auth.jwt: algorithm {algorithm} needs {needs}")]
    MissingKey {
        /// The configured algorithm.
        algorithm: JwtAlgorithm,
        /// The key(s) to set.
        needs: &'static str,
    },
    /// A key is configured that the algorithm does not use, or two that exclude each other.
    #[error("auth.jwt: {key} {why}")]
    ConflictingKey {
        /// The key at fault.
        key: &'static str,
        /// Why it cannot be set.
        why: String,
    },
    /// The HS256 secret is too short.
    #[error(
        "auth.jwt: the HS256 secret has {len} bytes; at least {MIN_HS256_SECRET_BYTES} are needed"
    )]
    SecretTooShort {
        /// Its length.
        len: usize,
    },
    /// A key file could not be read.
    #[error("auth.jwt: cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A claim name is empty: no token could carry it.
    #[error("auth.jwt.{key} must not be empty (a claim's name)")]
    EmptyClaim {
        /// The key at fault.
        key: &'static str,
    },
    /// `leeway_secs` is more than [`MAX_LEEWAY_SECS`].
    #[error("auth.jwt.leeway_secs = {value} is more than {MAX_LEEWAY_SECS} (one day)")]
    LeewayTooLarge {
        /// The configured value.
        value: u64,
    },
    /// A key file holds no usable public key.
    #[error("auth.jwt: {}: {reason}", path.display())]
    Key {
        /// The file.
        path: PathBuf,
        /// What is wrong (no PEM section, not an RSA key, too short, ...).
        reason: String,
    },
}

/// Who a connection is, once its token verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// The user: a static token's `user`, a JWT's `sub`.
    pub user: String,
    /// What the user may do.
    pub permissions: Arc<Permissions>,
    /// The instant from which this authenticator refuses the token as expired (its `exp` plus
    /// the configured leeway): the connection is to be closed then unless it presented a fresh
    /// token. `None` for static tokens and JWTs without `exp`.
    pub expires_at: Option<SystemTime>,
    /// The user's own publish rates, where its entry (`[[auth.tokens]]`,
    /// `[[auth.certificates]]`) or its JWT's [`RATES_CLAIM`] sets them; otherwise the `[auth]`
    /// `*_per_user` defaults apply.
    pub publish_rates: UserRates,
    /// The user's own connection and subscription limits, where its entry or its JWT's
    /// [`LIMITS_CLAIM`] sets them; otherwise `[auth] max_connections_per_user` and
    /// `max_subscriptions_per_user` apply.
    pub limits: UserLimits,
}

/// A user's connection and subscription limits, as an `[[auth.tokens]]` or
/// `[[auth.certificates]]` entry (`limits = { ... }`) or a JWT's [`LIMITS_CLAIM`] sets them;
/// `None` takes the `[auth]` default (`max_connections_per_user`,
/// `max_subscriptions_per_user`), `Some(0)` is no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UserLimits {
    /// Most connections the user may hold authenticated at a time.
    pub max_connections: Option<usize>,
    /// Most subscriptions the user may hold across its connections.
    pub max_subscriptions: Option<usize>,
}

/// The reader of [`UserLimits`] (see [`super::deserialize_from_map_only`]).
#[derive(Deserialize)]
#[serde(remote = "UserLimits", deny_unknown_fields)]
struct UserLimitsDef {
    #[serde(default)]
    max_connections: Option<usize>,
    #[serde(default)]
    max_subscriptions: Option<usize>,
}

/// The reader of [`UserRates`] (see [`super::deserialize_from_map_only`]).
#[derive(Deserialize)]
#[serde(remote = "UserRates", deny_unknown_fields)]
struct UserRatesDef {
    #[serde(default)]
    publish_messages_per_second: Option<u64>,
    #[serde(default)]
    publish_bytes_per_second: Option<u64>,
}

super::deserialize_from_map_only!(UserLimits, UserLimitsDef);
super::deserialize_from_map_only!(UserRates, UserRatesDef);

impl UserLimits {
    /// These limits, each falling back to the default given (connections, subscriptions).
    ///
    /// ```
    /// use powerhub::security::auth::UserLimits;
    ///
    /// let own = UserLimits { max_connections: Some(2), max_subscriptions: None };
    /// assert_eq!(own.or((10, 100)), (2, 100));
    /// assert_eq!(UserLimits { max_connections: Some(0), ..own }.or((10, 100)), (0, 100));
    /// ```
    pub fn or(self, defaults: (usize, usize)) -> (usize, usize) {
        (
            self.max_connections.unwrap_or(defaults.0),
            self.max_subscriptions.unwrap_or(defaults.1),
        )
    }
}

/// A user's publish rates across its connections, as an `[[auth.tokens]]` or
/// `[[auth.certificates]]` entry sets them; `None` takes the `[auth]` default
/// (`publish_messages_per_second_per_user`, `publish_bytes_per_second_per_user`), `Some(0)` is
/// no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UserRates {
    /// Messages per second, summed over the user's connections.
    pub publish_messages_per_second: Option<u64>,
    /// Bytes of messages per second, summed over the user's connections.
    pub publish_bytes_per_second: Option<u64>,
}

impl UserRates {
    /// These rates, each falling back to the default given (messages, bytes per second).
    ///
    /// ```
    /// use powerhub::security::auth::UserRates;
    ///
    /// let own = UserRates { publish_messages_per_second: Some(10), publish_bytes_per_second: None };
    /// assert_eq!(own.or((100, 4096)), (10, 4096));
    /// ```
    pub fn or(self, defaults: (u64, u64)) -> (u64, u64) {
        (
            self.publish_messages_per_second.unwrap_or(defaults.0),
            self.publish_bytes_per_second.unwrap_or(defaults.1),
        )
    }
}

impl Identity {
    /// How long until [`Identity::expires_at`] (zero once passed); `None` if it never expires.
    pub fn remaining(&self, now: SystemTime) -> Option<Duration> {
        self.expires_at
            .map(|at| at.duration_since(now).unwrap_or(Duration::ZERO))
    }
}

/// Which part of a JWT was malformed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenPart {
    /// The token as a whole (its shape or length).
    Token,
    /// The header (first part).
    Header,
    /// The claims (second part).
    Payload,
    /// The signature (third part).
    Signature,
}

impl TokenPart {
    /// The part in an error message: "token", "token header", ...
    fn noun(self) -> &'static str {
        match self {
            TokenPart::Token => "token",
            TokenPart::Header => "token header",
            TokenPart::Payload => "token payload",
            TokenPart::Signature => "token signature",
        }
    }
}

impl fmt::Display for TokenPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TokenPart::Token => "token",
            TokenPart::Header => "header",
            TokenPart::Payload => "payload",
            TokenPart::Signature => "signature",
        })
    }
}

/// Why a presented token was refused. Each variant has a short, stable [`AuthError::code`] for
/// the protocol's error reply; the message never repeats the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// No static token matches, and the token is not a JWT this server verifies.
    #[error("unknown token")]
    UnknownToken,
    /// The JWT's signature does not verify with the configured key.
    #[error("the token's signature does not verify")]
    BadSignature,
    /// `now` is at or past the JWT's `exp` (plus leeway).
    #[error("the token expired at {exp} (unix time)")]
    Expired {
        /// The token's `exp`, in seconds since the epoch.
        exp: u64,
    },
    /// `now` is before the JWT's `nbf` (less leeway).
    #[error("the token is not valid before {nbf} (unix time)")]
    NotYetValid {
        /// The token's `nbf`, in seconds since the epoch.
        nbf: u64,
    },
    /// The JWT's `aud` does not name this server's audience, or names one when this server
    /// expects none.
    #[error("{}", match expected {
        Some(a) => format!("the token's audience does not include `{a}`"),
        None => "the token names an audience and this server is configured with none".to_owned(),
    })]
    WrongAudience {
        /// The configured audience.
        expected: Option<String>,
    },
    /// The JWT's `iss` is absent or not the configured issuer.
    #[error("the token's issuer is not `{expected}`")]
    WrongIssuer {
        /// The configured issuer.
        expected: String,
    },
    /// The token is not a well-formed JWT: not three base64url parts, a part that does not
    /// decode, a header or payload that is not a JSON object, or a claim of the wrong type.
    #[error("malformed {}: {reason}", part.noun())]
    Malformed {
        /// The part at fault.
        part: TokenPart,
        /// What is wrong.
        reason: String,
    },
    /// The JWT's header says `alg: none` (an unsigned token).
    #[error("unsigned tokens (alg `none`) are refused")]
    AlgNone,
    /// The JWT's header names an algorithm other than the configured one.
    #[error("algorithm `{alg}` is not allowed; this server accepts {expected}")]
    AlgorithmNotAllowed {
        /// The header's `alg` (at most 32 characters of it).
        alg: String,
        /// The configured algorithm.
        expected: JwtAlgorithm,
    },
    /// The JWT has no `sub` claim (or an empty one): there is no user.
    #[error("the token has no `sub` claim")]
    MissingSub,
    /// The JWT has no `exp` claim, and the server requires one (`[auth.jwt] require_exp`).
    #[error("the token has no `exp` claim, and this server requires one (auth.jwt.require_exp)")]
    MissingExp,
    /// The JWT's permissions claim is not a permission set, or holds an invalid pattern; or its
    /// [`RATES_CLAIM`] is not a set of rates.
    #[error("the token's `{claim}` claim: {reason}")]
    InvalidPermissions {
        /// The claim's name.
        claim: String,
        /// What is wrong.
        reason: String,
    },
}

impl AuthError {
    /// Every code [`AuthError::code`] can return.
    pub const CODES: &'static [&'static str] = &[
        codes::UNKNOWN_TOKEN,
        codes::BAD_SIGNATURE,
        codes::TOKEN_EXPIRED,
        codes::TOKEN_NOT_YET_VALID,
        codes::WRONG_AUDIENCE,
        codes::WRONG_ISSUER,
        codes::MALFORMED_TOKEN,
        codes::ALG_NONE,
        codes::ALGORITHM_NOT_ALLOWED,
        codes::MISSING_SUB,
        codes::MISSING_EXP,
        codes::INVALID_PERMISSIONS,
    ];

    /// The machine-readable code for the protocol's error reply (`{"type":"error",
    /// "code":"token_expired",...}`): one per variant, from [`AuthError::CODES`].
    pub fn code(&self) -> &'static str {
        match self {
            AuthError::UnknownToken => codes::UNKNOWN_TOKEN,
            AuthError::BadSignature => codes::BAD_SIGNATURE,
            AuthError::Expired { .. } => codes::TOKEN_EXPIRED,
            AuthError::NotYetValid { .. } => codes::TOKEN_NOT_YET_VALID,
            AuthError::WrongAudience { .. } => codes::WRONG_AUDIENCE,
            AuthError::WrongIssuer { .. } => codes::WRONG_ISSUER,
            AuthError::Malformed { .. } => codes::MALFORMED_TOKEN,
            AuthError::AlgNone => codes::ALG_NONE,
            AuthError::AlgorithmNotAllowed { .. } => codes::ALGORITHM_NOT_ALLOWED,
            AuthError::MissingSub => codes::MISSING_SUB,
            AuthError::MissingExp => codes::MISSING_EXP,
            AuthError::InvalidPermissions { .. } => codes::INVALID_PERMISSIONS,
        }
    }
}

/// A malformed token; `reason` may quote the token (a parser's error), so it is cut to what
/// an error echoes of client text ([`codes::MAX_ECHO_BYTES`]).
fn malformed(part: TokenPart, reason: impl Into<String>) -> AuthError {
    AuthError::Malformed {
        part,
        reason: codes::echo(&reason.into()),
    }
}

struct StaticEntry {
    digest: [u8; 32],
    user: String,
    permissions: Arc<Permissions>,
    rates: UserRates,
    limits: UserLimits,
}

struct JwtVerifier {
    algorithm: JwtAlgorithm,
    key: DecodingKey,
    validation: Validation,
    audience: Option<String>,
    issuer: Option<String>,
    permissions_claim: String,
    leeway_secs: u64,
    require_exp: bool,
}

/// Verifies presented tokens against an `[auth]` configuration. Immutable once built: to reload
/// keys (SIGHUP), build a new one and swap it in; identities already issued keep their
/// permissions.
pub struct Authenticator {
    tokens: Vec<StaticEntry>,
    jwt: Option<JwtVerifier>,
    /// `[[auth.certificates]]`: the subject and the identity it stands for.
    certificates: Vec<(String, Identity)>,
}

impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator")
            .field("static_tokens", &self.tokens.len())
            .field("jwt", &self.jwt.as_ref().map(|j| j.algorithm))
            .field("certificates", &self.certificates.len())
            .finish()
    }
}

/// The `[[auth.certificates]]` entries, checked.
fn certificate_users(
    entries: &[CertificateUserConfig],
) -> Result<Vec<(String, Identity)>, AuthConfigError> {
    let mut out: Vec<(String, Identity)> = Vec::with_capacity(entries.len());
    for (index, e) in entries.iter().enumerate() {
        let refuse = |reason: String| AuthConfigError::Certificate { index, reason };
        if e.subject.is_empty() {
            return Err(refuse("subject must not be empty".into()));
        }
        if let Some(part) = not_a_dn_part(&e.subject) {
            return Err(refuse(format!(
                "subject `{}` is not an RFC 4514 distinguished name (as `CN=alice,O=Example`): \
                 `{part}` is no `attribute=value`, so no certificate could match it",
                e.subject
            )));
        }
        if let Some(reason) = not_as_printed(&e.subject) {
            return Err(refuse(format!(
                "subject `{}` {reason}, so no certificate could match it (the subject is compared \
                 exactly with the certificate's, as `openssl x509 -noout -subject -nameopt \
                 RFC2253` prints it)",
                e.subject
            )));
        }
        if let Some(first) = out.iter().position(|(s, _)| *s == e.subject) {
            return Err(refuse(format!(
                "subject `{}` repeats auth.certificates[{first}].subject",
                e.subject
            )));
        }
        let user = match &e.user {
            Some(u) if u.is_empty() => return Err(refuse("user must not be empty".into())),
            Some(u) => u.clone(),
            None => common_name_of(&e.subject).unwrap_or(&e.subject).to_owned(),
        };
        let permissions = Permissions::compile(&e.permissions)
            .map_err(|source| refuse(format!("(user `{user}`): {source}")))?;
        let identity = Identity {
            user,
            permissions: Arc::new(permissions),
            expires_at: None,
            publish_rates: e.rates,
            limits: e.limits,
        };
        out.push((e.subject.clone(), identity));
    }
    Ok(out)
}

/// The first part of `subject` (split at its unescaped `,` and `+`) that is not an RFC 4514
/// `attribute=value`: an attribute that is a keyword (`CN`, `O`, `emailAddress`) or a dotted
/// OID, and a value (empty or not). `None` when every part is one.
fn not_a_dn_part(subject: &str) -> Option<&str> {
    dn_parts(subject).find(|part| {
        let Some((attr, _value)) = part.split_once('=') else {
            return true;
        };
        let attr = attr.trim();
        let keyword = attr.starts_with(|c: char| c.is_ascii_alphabetic())
            && attr.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        let oid = !attr.is_empty()
            && attr
                .split('.')
                .all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()));
        !(keyword || oid)
    })
}

/// The parts of an RFC 4514 `subject`: split at its unescaped `,` and `+`.
fn dn_parts(subject: &str) -> impl Iterator<Item = &str> {
    let mut start = 0;
    let mut escaped = false;
    let mut ends = subject
        .char_indices()
        .filter_map(move |(i, c)| {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                ',' | '+' => return Some(i),
                _ => {}
            }
            None
        })
        .chain(std::iter::once(subject.len()));
    std::iter::from_fn(move || {
        let end = ends.next()?;
        let part = &subject[start..end];
        start = end + 1;
        Some(part)
    })
}

/// Why a DN `subject` is written as no certificate's subject is printed, if it is: a space
/// around a separator or an attribute's `=` (RFC 4514 strings have none but escaped ones), or a
/// standard attribute keyword not in capitals (`cn=` for `CN=`).
fn not_as_printed(subject: &str) -> Option<String> {
    const KEYWORDS: [&str; 9] = ["CN", "O", "OU", "C", "L", "ST", "STREET", "DC", "UID"];
    for part in dn_parts(subject) {
        let (attr, value) = part.split_once('=')?;
        if attr != attr.trim() || value.starts_with(' ') {
            return Some(format!(
                "has a space around `{}` (write `{}={}`)",
                part.trim(),
                attr.trim(),
                value.trim_start()
            ));
        }
        if let Some(k) = KEYWORDS
            .iter()
            .find(|k| k.eq_ignore_ascii_case(attr) && **k != attr)
        {
            return Some(format!("writes `{attr}=` where certificates print `{k}=`"));
        }
    }
    None
}

/// The first `CN=` value of an RFC 4514 subject string, as [`PeerSubject::user`] takes it from
/// a certificate (unescaped values only: a common name with an escaped `,` or `+` is taken up
/// to it; name the user with `user` then).
fn common_name_of(subject: &str) -> Option<&str> {
    subject
        .split([',', '+'])
        .find_map(|part| part.trim().strip_prefix("CN="))
        .filter(|cn| !cn.is_empty() && !cn.contains('\\'))
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

impl Authenticator {
    /// Builds the authenticator, reading key files from the file system.
    ///
    /// # Errors
    ///
    /// See [`AuthConfigError`]: no credentials, an empty or repeated token, an invalid
    /// permission pattern, a missing, conflicting, unreadable or unusable key.
    pub fn from_config(config: &AuthConfig) -> Result<Authenticator, AuthConfigError> {
        Self::from_config_with(config, |p| std::fs::read(p))
    }

    /// Builds the authenticator, reading key files through `read` (tests hand in keys from
    /// memory; a reload can read through its own cache).
    ///
    /// # Errors
    ///
    /// As [`Authenticator::from_config`].
    pub fn from_config_with(
        config: &AuthConfig,
        mut read: impl FnMut(&Path) -> io::Result<Vec<u8>>,
    ) -> Result<Authenticator, AuthConfigError> {
        if config.tokens.is_empty() && config.jwt.is_none() && config.certificates.is_empty() {
            return Err(AuthConfigError::NoCredentials);
        }
        let mut tokens: Vec<StaticEntry> = Vec::with_capacity(config.tokens.len());
        for (index, t) in config.tokens.iter().enumerate() {
            if t.token.is_empty() {
                return Err(AuthConfigError::Empty {
                    index,
                    key: "token",
                });
            }
            if t.user.is_empty() {
                return Err(AuthConfigError::Empty { index, key: "user" });
            }
            if t.token.len() > MAX_TOKEN_BYTES {
                return Err(AuthConfigError::TokenTooLong {
                    index,
                    len: t.token.len(),
                });
            }
            let d = digest(t.token.as_bytes());
            if let Some(first) = tokens.iter().position(|e| e.digest == d) {
                return Err(AuthConfigError::DuplicateToken { index, first });
            }
            let permissions = Permissions::compile(&t.permissions).map_err(|source| {
                AuthConfigError::Permissions {
                    index,
                    user: t.user.clone(),
                    source,
                }
            })?;
            tokens.push(StaticEntry {
                digest: d,
                user: t.user.clone(),
                permissions: Arc::new(permissions),
                rates: t.rates,
                limits: t.limits,
            });
        }
        let jwt = config
            .jwt
            .as_ref()
            .map(|j| JwtVerifier::new(j, &mut read))
            .transpose()?;
        let certificates = certificate_users(&config.certificates)?;
        Ok(Authenticator {
            tokens,
            jwt,
            certificates,
        })
    }

    /// The identity a verified client certificate with `subject` authenticates as: its
    /// `[[auth.certificates]]` entry's, or `None` when the subject is not listed (the
    /// connection then authenticates with a token, as any other).
    ///
    /// ```
    /// use powerhub::security::auth::{AuthConfig, Authenticator};
    /// use powerhub::security::tls::PeerSubject;
    ///
    /// let config: AuthConfig = toml::from_str(r#"
    ///     [[certificates]]
    ///     subject = "CN=sensor-7,O=Example"
    ///     permissions = { publish = { allow = ["telemetry/sensor-7"] } }
    /// "#).unwrap();
    /// let auth = Authenticator::from_config(&config).unwrap();
    /// let subject = PeerSubject {
    ///     distinguished_name: "CN=sensor-7,O=Example".into(),
    ///     common_name: Some("sensor-7".into()),
    /// };
    /// let who = auth.verify_certificate(&subject).unwrap();
    /// assert_eq!(who.user, "sensor-7");
    /// assert!(who.permissions.publish("telemetry", Some("sensor-7")).is_allowed());
    /// assert!(who.expires_at.is_none());
    ///
    /// let other = PeerSubject { distinguished_name: "CN=sensor-8,O=Example".into(), common_name: Some("sensor-8".into()) };
    /// assert!(auth.verify_certificate(&other).is_none());
    /// ```
    pub fn verify_certificate(&self, subject: &PeerSubject) -> Option<Identity> {
        self.certificates
            .iter()
            .find(|(s, _)| *s == subject.distinguished_name)
            .map(|(_, identity)| identity.clone())
    }

    /// Verifies `token` at `now`: a static token, else a JWT (three `.`-separated parts) when a
    /// `[auth.jwt]` section is configured.
    ///
    /// # Errors
    ///
    /// The reason for the refusal, one [`AuthError`] variant per reason.
    pub fn verify(&self, token: &str, now: SystemTime) -> Result<Identity, AuthError> {
        if token.len() > MAX_TOKEN_BYTES {
            return Err(malformed(
                TokenPart::Token,
                format!("longer than {MAX_TOKEN_BYTES} bytes"),
            ));
        }
        if let Some(entry) = self.find_static(token) {
            return Ok(Identity {
                user: entry.user.clone(),
                permissions: Arc::clone(&entry.permissions),
                expires_at: None,
                publish_rates: entry.rates,
                limits: entry.limits,
            });
        }
        let Some(jwt) = &self.jwt else {
            return Err(AuthError::UnknownToken);
        };
        if token.split('.').count() != 3 {
            return Err(if self.tokens.is_empty() {
                malformed(
                    TokenPart::Token,
                    "not a JWT (three base64url parts separated by `.`)",
                )
            } else {
                AuthError::UnknownToken
            });
        }
        jwt.verify(token, now)
    }

    /// The static entry whose token is `token`. Every entry is compared, in constant time, so
    /// the time taken does not tell which entry (or how much of one) matched.
    fn find_static(&self, token: &str) -> Option<&StaticEntry> {
        if self.tokens.is_empty() {
            return None;
        }
        let d = digest(token.as_bytes());
        let mut found = subtle::Choice::from(0);
        let mut index = 0u64;
        for (i, e) in self.tokens.iter().enumerate() {
            let eq = e.digest.ct_eq(&d);
            index = u64::conditional_select(&index, &(i as u64), eq);
            found |= eq;
        }
        bool::from(found).then(|| &self.tokens[index as usize])
    }
}

impl JwtVerifier {
    fn new(
        config: &JwtConfig,
        read: &mut impl FnMut(&Path) -> io::Result<Vec<u8>>,
    ) -> Result<JwtVerifier, AuthConfigError> {
        let algorithm = config.algorithm;
        let mut read_file = |path: &Path| {
            read(path).map_err(|source| AuthConfigError::Read {
                path: path.to_owned(),
                source,
            })
        };
        let key = match algorithm {
            JwtAlgorithm::Hs256 => {
                if config.public_key_file.is_some() {
                    return Err(AuthConfigError::ConflictingKey {
                        key: "public_key_file",
                        why: "is for RS256 and ES256; HS256 uses `secret` or `secret_file`".into(),
                    });
                }
                let secret = match (&config.secret, &config.secret_file) {
                    (Some(_), Some(_)) => {
                        return Err(AuthConfigError::ConflictingKey {
                            key: "secret",
                            why: "and `secret_file` are both set; give one".into(),
                        })
                    }
                    (Some(s), None) => s.as_bytes().to_vec(),
                    (None, Some(path)) => {
                        let mut s = read_file(path)?;
                        for end in [b'\n', b'\r'] {
                            if s.last() == Some(&end) {
                                s.pop();
                            }
                        }
                        s
                    }
                    (None, None) => {
                        return Err(AuthConfigError::MissingKey {
                            algorithm,
                            needs: "`secret` or `secret_file`",
                        })
                    }
                };
                if secret.len() < MIN_HS256_SECRET_BYTES {
                    return Err(AuthConfigError::SecretTooShort { len: secret.len() });
                }
                DecodingKey::from_secret(&secret)
            }
            JwtAlgorithm::Rs256 | JwtAlgorithm::Es256 => {
                for (set, key) in [
                    (config.secret.is_some(), "secret"),
                    (config.secret_file.is_some(), "secret_file"),
                ] {
                    if set {
                        return Err(AuthConfigError::ConflictingKey {
                            key,
                            why: format!("is for HS256; {algorithm} uses `public_key_file`"),
                        });
                    }
                }
                let Some(path) = &config.public_key_file else {
                    return Err(AuthConfigError::MissingKey {
                        algorithm,
                        needs: "`public_key_file`",
                    });
                };
                let pem = read_file(path)?;
                public_key(algorithm, &pem).map_err(|reason| AuthConfigError::Key {
                    path: path.clone(),
                    reason,
                })?
            }
        };
        if config.permissions_claim.is_empty() {
            return Err(AuthConfigError::EmptyClaim {
                key: "permissions_claim",
            });
        }
        if config.leeway_secs > MAX_LEEWAY_SECS {
            return Err(AuthConfigError::LeewayTooLarge {
                value: config.leeway_secs,
            });
        }
        let mut validation = Validation::new(algorithm.jsonwebtoken());
        // Only the signature is left to jsonwebtoken: it would read the system clock for `exp`
        // and `nbf`, and each claim check here names its own error.
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.validate_aud = false;
        validation.required_spec_claims.clear();
        Ok(JwtVerifier {
            algorithm,
            key,
            validation,
            audience: config.audience.clone(),
            issuer: config.issuer.clone(),
            permissions_claim: config.permissions_claim.clone(),
            leeway_secs: config.leeway_secs,
            require_exp: config.require_exp,
        })
    }

    fn verify(&self, token: &str, now: SystemTime) -> Result<Identity, AuthError> {
        let mut parts = token.split('.');
        let (Some(header), Some(_payload), Some(signature)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(malformed(TokenPart::Token, "not three parts"));
        };
        let header = json_object(header, TokenPart::Header)?;
        let alg = match header.get("alg") {
            Some(Value::String(a)) => a,
            Some(_) => return Err(malformed(TokenPart::Header, "`alg` is not a string")),
            None => return Err(malformed(TokenPart::Header, "no `alg`")),
        };
        if alg.eq_ignore_ascii_case("none") {
            return Err(AuthError::AlgNone);
        }
        if header.contains_key("crit") {
            // RFC 7515 §4.1.11: critical extensions the verifier does not understand (this one
            // understands none) make the token invalid.
            return Err(malformed(
                TokenPart::Header,
                "`crit` lists extensions this server does not implement",
            ));
        }
        if alg != self.algorithm.as_str() {
            return Err(AuthError::AlgorithmNotAllowed {
                alg: alg.chars().take(32).collect(),
                expected: self.algorithm,
            });
        }
        if base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(signature)
            .is_err()
        {
            return Err(malformed(TokenPart::Signature, "not base64url"));
        }
        let claims: Map<String, Value> =
            match jsonwebtoken::decode(token, &self.key, &self.validation) {
                Ok(data) => data.claims,
                Err(e) => return Err(self.decode_error(e.into_kind())),
            };
        self.identity(claims, now)
    }

    /// Maps what jsonwebtoken refused. The header and signature encodings were checked before,
    /// so a base64 or JSON error here is the payload's.
    fn decode_error(&self, kind: JwtErrorKind) -> AuthError {
        match kind {
            JwtErrorKind::InvalidSignature => AuthError::BadSignature,
            JwtErrorKind::Base64(_) => malformed(TokenPart::Payload, "not base64url"),
            JwtErrorKind::Json(e) => malformed(
                TokenPart::Payload,
                format!("not a JSON object of claims ({e})"),
            ),
            JwtErrorKind::Utf8(_) => malformed(TokenPart::Payload, "not UTF-8"),
            JwtErrorKind::InvalidToken => malformed(TokenPart::Token, "not three parts"),
            JwtErrorKind::InvalidAlgorithm => AuthError::AlgorithmNotAllowed {
                alg: String::new(),
                expected: self.algorithm,
            },
            // The key was checked when the configuration was loaded; whatever else goes wrong
            // in the cryptography is a signature that does not verify.
            _ => AuthError::BadSignature,
        }
    }

    fn identity(&self, claims: Map<String, Value>, now: SystemTime) -> Result<Identity, AuthError> {
        let now_secs = now
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let exp = numeric_date(&claims, "exp")?;
        let nbf = numeric_date(&claims, "nbf")?;
        // Registered claims the server does not act on are still of their type (RFC 7519,
        // section 4.1): `iat` a number (any NumericDate, before the epoch too), `jti` a string.
        if claims.get("iat").is_some_and(|i| !i.is_number()) {
            return Err(malformed(TokenPart::Payload, "`iat` is not a NumericDate"));
        }
        if claims.get("jti").is_some_and(|j| !j.is_string()) {
            return Err(malformed(TokenPart::Payload, "`jti` is not a string"));
        }
        if exp.is_none() && self.require_exp {
            return Err(AuthError::MissingExp);
        }
        if let Some(exp) = exp {
            if now_secs >= exp.saturating_add(self.leeway_secs) {
                return Err(AuthError::Expired { exp });
            }
        }
        if let Some(nbf) = nbf {
            if now_secs.saturating_add(self.leeway_secs) < nbf {
                return Err(AuthError::NotYetValid { nbf });
            }
        }
        self.check_audience(claims.get("aud"))?;
        let iss = match claims.get("iss") {
            None => None,
            Some(Value::String(iss)) => Some(iss.as_str()),
            Some(_) => return Err(malformed(TokenPart::Payload, "`iss` is not a string")),
        };
        if let Some(expected) = &self.issuer {
            if iss != Some(expected.as_str()) {
                return Err(AuthError::WrongIssuer {
                    expected: expected.clone(),
                });
            }
        }
        let user = match claims.get("sub") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(Value::String(_)) | None => return Err(AuthError::MissingSub),
            Some(_) => return Err(malformed(TokenPart::Payload, "`sub` is not a string")),
        };
        let permissions = match claims.get(&self.permissions_claim) {
            None => Permissions::none(),
            Some(v) => {
                // The reasons quote the claim (a parser's error, a pattern): cut as an error
                // echoes client text.
                let invalid = |reason: String| AuthError::InvalidPermissions {
                    claim: self.permissions_claim.clone(),
                    reason: codes::echo(&reason),
                };
                let config = PermissionsConfig::deserialize(v)
                    .map_err(|e| invalid(format!("not a permission set ({e})")))?;
                Permissions::compile(&config).map_err(|e| invalid(e.to_string()))?
            }
        };
        // The user's own publish rates, as a static token's `rates`.
        let publish_rates = match claims.get(RATES_CLAIM) {
            None => UserRates::default(),
            Some(v) => UserRates::deserialize(v).map_err(|e| AuthError::InvalidPermissions {
                claim: RATES_CLAIM.to_owned(),
                reason: codes::echo(&format!("not a set of rates ({e})")),
            })?,
        };
        // And its own connection and subscription limits, as a static token's `limits`.
        let limits = match claims.get(LIMITS_CLAIM) {
            None => UserLimits::default(),
            Some(v) => UserLimits::deserialize(v).map_err(|e| AuthError::InvalidPermissions {
                claim: LIMITS_CLAIM.to_owned(),
                reason: codes::echo(&format!("not a set of limits ({e})")),
            })?,
        };
        Ok(Identity {
            user,
            permissions: Arc::new(permissions),
            // An `exp` past what the clock can represent (year 584 billion and later) never
            // comes: the token does not expire.
            expires_at: exp.and_then(|e| {
                UNIX_EPOCH.checked_add(Duration::from_secs(e.saturating_add(self.leeway_secs)))
            }),
            publish_rates,
            limits,
        })
    }

    fn check_audience(&self, aud: Option<&Value>) -> Result<(), AuthError> {
        let wrong = || AuthError::WrongAudience {
            expected: self.audience.clone(),
        };
        let names: Vec<&str> = match aud {
            None => Vec::new(),
            Some(Value::String(s)) => vec![s.as_str()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str())
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    malformed(
                        TokenPart::Payload,
                        "`aud` holds something other than strings",
                    )
                })?,
            Some(_) => {
                return Err(malformed(
                    TokenPart::Payload,
                    "`aud` is neither a string nor an array of strings",
                ))
            }
        };
        match &self.audience {
            Some(expected) if names.contains(&expected.as_str()) => Ok(()),
            Some(_) => Err(wrong()),
            None if names.is_empty() => Ok(()),
            None => Err(wrong()),
        }
    }
}

/// A base64url JSON object (the header).
fn json_object(part: &str, which: TokenPart) -> Result<Map<String, Value>, AuthError> {
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(part)
        .map_err(|_| malformed(which, "not base64url"))?;
    serde_json::from_slice(&bytes).map_err(|_| malformed(which, "not a JSON object"))
}

/// A NumericDate claim (RFC 7519 §2): a non-negative number of seconds, fractions dropped.
/// Anything else (a string, a negative number) is malformed, never "absent".
fn numeric_date(claims: &Map<String, Value>, name: &str) -> Result<Option<u64>, AuthError> {
    let Some(v) = claims.get(name) else {
        return Ok(None);
    };
    let bad = || malformed(TokenPart::Payload, format!("`{name}` is not a NumericDate"));
    let Value::Number(n) = v else {
        return Err(bad());
    };
    if let Some(secs) = n.as_u64() {
        return Ok(Some(secs));
    }
    match n.as_f64() {
        // `as` saturates: a date past u64::MAX seconds is "never".
        Some(f) if f.is_finite() && f >= 0.0 => Ok(Some(f as u64)),
        _ => Err(bad()),
    }
}

/// The public key of a PEM file (`PUBLIC KEY`, or a `CERTIFICATE`'s), checked against the
/// algorithm and turned into jsonwebtoken's key.
fn public_key(algorithm: JwtAlgorithm, pem_bytes: &[u8]) -> Result<DecodingKey, String> {
    let spki: Vec<u8> = match SubjectPublicKeyInfoDer::from_pem_slice(pem_bytes) {
        Ok(der) => der.as_ref().to_vec(),
        Err(pem::Error::NoItemsFound) => match CertificateDer::from_pem_slice(pem_bytes) {
            Ok(cert) => {
                use x509_cert::der::{Decode as _, Encode as _};
                let cert = x509_cert::Certificate::from_der(cert.as_ref())
                    .map_err(|e| format!("the CERTIFICATE does not parse: {e}"))?;
                cert.tbs_certificate
                    .subject_public_key_info
                    .to_der()
                    .map_err(|e| format!("the certificate's public key does not encode: {e}"))?
            }
            Err(pem::Error::NoItemsFound) => {
                return Err("no PUBLIC KEY or CERTIFICATE section in the PEM file".into())
            }
            Err(e) => return Err(format!("not a valid PEM file: {e}")),
        },
        Err(e) => return Err(format!("not a valid PEM file: {e}")),
    };
    match algorithm {
        JwtAlgorithm::Rs256 => {
            use rsa::pkcs8::DecodePublicKey as _;
            use rsa::traits::PublicKeyParts as _;
            let key = rsa::RsaPublicKey::from_public_key_der(&spki).map_err(|e| {
                format!(
                    "not an RSA public key, as RS256 needs ({})",
                    other_kind(&spki, RSA_OID, None).unwrap_or_else(|| e.to_string())
                )
            })?;
            let bits = key.n().bits();
            if bits < MIN_RSA_BITS {
                return Err(format!(
                    "the RSA key has {bits} bits; RS256 needs at least {MIN_RSA_BITS}"
                ));
            }
            Ok(DecodingKey::from_rsa_raw_components(
                &key.n().to_bytes_be(),
                &key.e().to_bytes_be(),
            ))
        }
        JwtAlgorithm::Es256 => {
            use p256::elliptic_curve::sec1::ToEncodedPoint as _;
            use p256::pkcs8::DecodePublicKey as _;
            let key = p256::PublicKey::from_public_key_der(&spki).map_err(|e| {
                format!(
                    "not a P-256 public key, as ES256 needs ({})",
                    other_kind(&spki, EC_OID, Some(P256_OID)).unwrap_or_else(|| e.to_string())
                )
            })?;
            Ok(DecodingKey::from_ec_der(
                key.to_encoded_point(false).as_bytes(),
            ))
        }
        JwtAlgorithm::Hs256 => unreachable!("HS256 has no public key"),
    }
}

const RSA_OID: &str = "1.2.840.113549.1.1.1";
const EC_OID: &str = "1.2.840.10045.2.1";
const P256_OID: &str = "1.2.840.10045.3.1.7";

/// What a DER `SubjectPublicKeyInfo` holds when it is not the key expected (algorithm
/// `want`, and curve `curve` for an EC key), for an error message ("the file holds an RSA
/// key"); `None` when it is the expected kind (the parser's own reason then says what is
/// wrong) or does not parse.
fn other_kind(spki: &[u8], want: &str, curve: Option<&str>) -> Option<String> {
    use x509_cert::der::Decode as _;
    let info = x509_cert::spki::SubjectPublicKeyInfoRef::from_der(spki).ok()?;
    let oid = info.algorithm.oid.to_string();
    let params = info.algorithm.parameters_oid().ok().map(|c| c.to_string());
    if oid == want && (curve.is_none() || params.as_deref() == curve) {
        return None;
    }
    let kind = match oid.as_str() {
        RSA_OID => "an RSA key".to_owned(),
        EC_OID => {
            let name = match params.as_deref() {
                Some(P256_OID) => "P-256".to_owned(),
                Some("1.3.132.0.34") => "P-384".to_owned(),
                Some("1.3.132.0.35") => "P-521".to_owned(),
                Some(other) => format!("curve {other}"),
                None => "an unnamed curve".to_owned(),
            };
            format!("an EC key on {name}")
        }
        "1.3.101.112" => "an Ed25519 key".to_owned(),
        other => format!("a key of algorithm {other}"),
    };
    Some(format!("the file holds {kind}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::json;

    const SECRET: &str = "0123456789abcdef0123456789abcdef-test";
    const T0: u64 = 1_700_000_000;
    const RSA_PRIVATE: &str = include_str!("../../tests/keys/rsa-2048.pem");
    const RSA_PUBLIC: &str = include_str!("../../tests/keys/rsa-2048.pub.pem");
    const RSA_OTHER_PUBLIC: &str = include_str!("../../tests/keys/rsa-2048-other.pub.pem");
    const RSA_SHORT_PUBLIC: &str = include_str!("../../tests/keys/rsa-1024.pub.pem");

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    fn hs_config() -> JwtConfig {
        JwtConfig {
            algorithm: JwtAlgorithm::Hs256,
            secret: Some(SECRET.into()),
            secret_file: None,
            public_key_file: None,
            audience: None,
            issuer: None,
            permissions_claim: DEFAULT_PERMISSIONS_CLAIM.into(),
            leeway_secs: 0,
            require_exp: false,
        }
    }

    fn with_jwt(jwt: JwtConfig) -> Authenticator {
        with_jwt_files(jwt, &[])
    }

    fn with_jwt_files(jwt: JwtConfig, files: &[(&str, &str)]) -> Authenticator {
        let config = AuthConfig {
            jwt: Some(jwt),
            ..AuthConfig::default()
        };
        Authenticator::from_config_with(&config, |p| read_from(files, p)).expect("valid config")
    }

    fn read_from(files: &[(&str, &str)], path: &Path) -> io::Result<Vec<u8>> {
        files
            .iter()
            .find(|(name, _)| Path::new(name) == path)
            .map(|(_, text)| text.as_bytes().to_vec())
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    fn hs_token(claims: &Value) -> String {
        jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            claims,
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap()
    }

    /// A token whose header and payload are exactly the given text, correctly signed: the
    /// refusal then comes from the content, not the signature.
    fn hs_signed_raw(header_b64: &str, payload_b64: &str) -> String {
        let message = format!("{header_b64}.{payload_b64}");
        let sig = jsonwebtoken::crypto::sign(
            message.as_bytes(),
            &EncodingKey::from_secret(SECRET.as_bytes()),
            Algorithm::HS256,
        )
        .unwrap();
        format!("{message}.{sig}")
    }

    fn hs_header() -> String {
        b64(br#"{"alg":"HS256","typ":"JWT"}"#)
    }

    fn good_claims() -> Value {
        json!({"sub": "alice", "exp": T0 + 60})
    }

    // ---- static tokens ----

    fn static_config() -> AuthConfig {
        toml::from_str(
            r#"
            [[tokens]]
            token = "token-one"
            user = "one"
            permissions = { publish = { allow = ["obs/>"] } }

            [[tokens]]
            token = "token-two"
            user = "two"
            "#,
        )
        .unwrap()
    }

    #[test]
    fn static_tokens_authenticate_their_user_and_nothing_else() {
        let auth = Authenticator::from_config(&static_config()).unwrap();
        let one = auth.verify("token-one", at(T0)).unwrap();
        assert_eq!(one.user, "one");
        assert_eq!(one.expires_at, None);
        assert!(one.permissions.publish("obs", Some("d")).is_allowed());
        let two = auth.verify("token-two", at(T0)).unwrap();
        assert_eq!(two.user, "two");
        assert!(!two.permissions.publish("obs", Some("d")).is_allowed());
        for wrong in ["token-three", "token-on", "token-one ", "", "a.b.c"] {
            let err = auth.verify(wrong, at(T0)).unwrap_err();
            assert_eq!(err, AuthError::UnknownToken, "{wrong:?}");
            assert_eq!(err.code(), "unknown_token");
        }
    }

    #[test]
    fn static_token_configuration_errors_name_the_entry() {
        let mut c = static_config();
        c.tokens[1].token = "token-one".into();
        assert!(matches!(
            Authenticator::from_config(&c),
            Err(AuthConfigError::DuplicateToken { index: 1, first: 0 })
        ));
        let mut c = static_config();
        c.tokens[0].user = String::new();
        let err = Authenticator::from_config(&c).unwrap_err();
        assert_eq!(err.to_string(), "auth.tokens[0].user must not be empty");
        // A token no client could present (longer than a presented token may be).
        let mut c = static_config();
        c.tokens[1].token = "t".repeat(MAX_TOKEN_BYTES + 1);
        let err = Authenticator::from_config(&c).unwrap_err();
        assert!(
            matches!(err, AuthConfigError::TokenTooLong { index: 1, .. }),
            "{err}"
        );
        c.tokens[1].token = "t".repeat(MAX_TOKEN_BYTES);
        assert!(Authenticator::from_config(&c).is_ok());
        let mut c = static_config();
        c.tokens[1].permissions.subscribe.deny = vec!["a/>/b".into()];
        let err = Authenticator::from_config(&c).unwrap_err();
        assert!(matches!(err, AuthConfigError::Permissions { index: 1, .. }));
        assert!(err.to_string().contains("`a/>/b`"), "{err}");
        assert!(matches!(
            Authenticator::from_config(&AuthConfig::default()),
            Err(AuthConfigError::NoCredentials)
        ));
    }

    #[test]
    fn config_parses_refuses_unknown_keys_and_hides_secrets_from_debug() {
        let c: AuthConfig = toml::from_str(
            r#"
            [jwt]
            algorithm = "RS256"
            public_key_file = "/etc/powerhub/jwt.pub.pem"
            audience = "powerhub"
            issuer = "https://id.example"
            permissions_claim = "https://powerhub.example/permissions"
            leeway_secs = 5
            "#,
        )
        .unwrap();
        let j = c.jwt.as_ref().unwrap();
        assert_eq!(j.algorithm, JwtAlgorithm::Rs256);
        assert_eq!(j.leeway_secs, 5);
        let d: AuthConfig = toml::from_str("[jwt]\nalgorithm = \"HS256\"\nsecret = \"x\"").unwrap();
        assert_eq!(
            d.jwt.as_ref().unwrap().permissions_claim,
            DEFAULT_PERMISSIONS_CLAIM
        );
        assert!(toml::from_str::<AuthConfig>("[jwt]\nalgorithm = \"HS512\"").is_err());
        assert!(toml::from_str::<AuthConfig>("[jwt]\nalgorithm = \"HS256\"\nkey = \"x\"").is_err());
        assert!(toml::from_str::<AuthConfig>("enabled = true").is_err());
        let debug = format!("{:?}", static_config());
        assert!(!debug.contains("token-one"), "{debug}");
        let debug = format!("{:?}", d);
        assert!(!debug.contains("secret: Some(\"x\")"), "{debug}");
    }

    fn subject(dn: &str, cn: Option<&str>) -> PeerSubject {
        PeerSubject {
            distinguished_name: dn.to_owned(),
            common_name: cn.map(str::to_owned),
        }
    }

    /// A subject no certificate could have, or a claim no token could carry, is refused at
    /// start with the entry or key named.
    #[test]
    fn a_certificate_subject_that_is_no_dn_and_an_empty_claim_name_are_refused() {
        for bad in ["not a dn", "CN=a,not a dn", "CN=a,=b", "C N=a"] {
            let config: AuthConfig =
                toml::from_str(&format!("[[certificates]]\nsubject = {bad:?}\n")).unwrap();
            let err = Authenticator::from_config(&config).unwrap_err().to_string();
            assert!(
                err.contains("auth.certificates[0]") && err.contains("RFC 4514"),
                "{bad}: {err}"
            );
        }
        // Written as no certificate's subject is printed: said so, naming the part.
        for (bad, part) in [
            ("CN=sensor-7, O=Example", "O=Example"),
            ("CN =a", "CN=a"),
            ("cn=sensor-7,o=Example", "cn="),
            ("CN=a,Ou=b", "Ou="),
        ] {
            let config: AuthConfig =
                toml::from_str(&format!("[[certificates]]\nsubject = {bad:?}\n")).unwrap();
            let err = Authenticator::from_config(&config).unwrap_err().to_string();
            assert!(
                err.contains("auth.certificates[0]") && err.contains(part),
                "{bad}: {err}"
            );
        }
        for good in [
            "CN=a",
            "CN=a\\,b,O=Example",
            "CN=a+UID=7,O=Ex",
            "2.5.4.3=a",
            "emailAddress=x@y,CN=",
        ] {
            let config: AuthConfig =
                toml::from_str(&format!("[[certificates]]\nsubject = {good:?}\n")).unwrap();
            assert!(Authenticator::from_config(&config).is_ok(), "{good}");
        }
        let config = AuthConfig {
            jwt: Some(JwtConfig {
                permissions_claim: String::new(),
                ..hs_config()
            }),
            ..AuthConfig::default()
        };
        let err = Authenticator::from_config_with(&config, |p| read_from(&[], p))
            .unwrap_err()
            .to_string();
        assert!(err.contains("auth.jwt.permissions_claim"), "{err}");
    }

    #[test]
    fn a_listed_certificate_subject_authenticates_its_user_and_nothing_else_does() {
        let config: AuthConfig = toml::from_str(
            r#"
            [[certificates]]
            subject = "CN=sensor-7,O=Example"
            permissions = { publish = { allow = ["telemetry/sensor-7"] } }
            [[certificates]]
            subject = "O=Example,C=DE"
            [[certificates]]
            subject = "CN=ops,O=Example"
            user = "operator"
            "#,
        )
        .unwrap();
        let auth = Authenticator::from_config(&config).unwrap();
        let who = auth
            .verify_certificate(&subject("CN=sensor-7,O=Example", Some("sensor-7")))
            .unwrap();
        assert_eq!(who.user, "sensor-7");
        assert!(who
            .permissions
            .publish("telemetry", Some("sensor-7"))
            .is_allowed());
        assert!(!who
            .permissions
            .publish("telemetry", Some("sensor-8"))
            .is_allowed());
        let no_cn = auth
            .verify_certificate(&subject("O=Example,C=DE", None))
            .unwrap();
        assert_eq!(no_cn.user, "O=Example,C=DE");
        let named = auth.verify_certificate(&subject("CN=ops,O=Example", Some("ops")));
        assert_eq!(named.unwrap().user, "operator");
        // Compared exactly: another order, another case, a prefix are other subjects.
        for other in [
            "O=Example,CN=sensor-7",
            "cn=sensor-7,o=example",
            "CN=sensor-7",
        ] {
            assert!(
                auth.verify_certificate(&subject(other, Some("sensor-7")))
                    .is_none(),
                "{other}"
            );
        }
        // Certificates alone are credentials enough; no token verifies then.
        assert_eq!(
            auth.verify("CN=sensor-7,O=Example", at(T0)),
            Err(AuthError::UnknownToken)
        );
    }

    #[test]
    fn an_entry_may_set_its_users_publish_rates() {
        let config: AuthConfig = toml::from_str(
            r#"
            [[tokens]]
            token = "t1"
            user = "slow"
            rates = { publish_messages_per_second = 5, publish_bytes_per_second = 0 }
            [[tokens]]
            token = "t2"
            user = "default"
            [[certificates]]
            subject = "CN=meter"
            rates = { publish_bytes_per_second = 2048 }
            "#,
        )
        .unwrap();
        let auth = Authenticator::from_config(&config).unwrap();
        let slow = auth.verify("t1", at(T0)).unwrap().publish_rates;
        assert_eq!(slow.or((100, 100)), (5, 0));
        let default = auth.verify("t2", at(T0)).unwrap().publish_rates;
        assert_eq!(default.or((100, 200)), (100, 200));
        let meter = auth
            .verify_certificate(&subject("CN=meter", Some("meter")))
            .unwrap()
            .publish_rates;
        assert_eq!(meter.or((100, 200)), (100, 2048));
        assert!(toml::from_str::<AuthConfig>(
            "[[tokens]]\ntoken = \"t\"\nuser = \"u\"\nrates = { messages = 1 }"
        )
        .is_err());
    }

    #[test]
    fn a_jwt_may_give_its_user_publish_rates_in_its_rates_claim() {
        let mut config = static_config();
        config.jwt = Some(hs_config());
        let auth = Authenticator::from_config(&config).unwrap();
        let mut claims = good_claims();
        claims["rates"] = serde_json::json!({"publish_messages_per_second": 7});
        let who = auth.verify(&hs_token(&claims), at(T0)).unwrap();
        assert_eq!(who.publish_rates.or((100, 200)), (7, 200));
        assert_eq!(
            auth.verify(&hs_token(&good_claims()), at(T0))
                .unwrap()
                .publish_rates,
            UserRates::default()
        );
        claims["rates"] = serde_json::json!({"messages": 7});
        let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
        assert!(
            matches!(&err, AuthError::InvalidPermissions { claim, .. } if claim == "rates"),
            "{err:?}"
        );
    }

    #[test]
    fn an_entry_or_a_jwt_may_set_its_users_connection_and_subscription_limits() {
        let mut config: AuthConfig = toml::from_str(
            r#"
            [[tokens]]
            token = "t1"
            user = "kiosk"
            limits = { max_connections = 1, max_subscriptions = 0 }
            [[tokens]]
            token = "t2"
            user = "default"
            [[certificates]]
            subject = "CN=meter"
            limits = { max_subscriptions = 4 }
            "#,
        )
        .unwrap();
        config.jwt = Some(hs_config());
        let auth = Authenticator::from_config(&config).unwrap();
        let limits = |token: &str| auth.verify(token, at(T0)).unwrap().limits;
        assert_eq!(limits("t1").or((10, 100)), (1, 0));
        assert_eq!(limits("t2").or((10, 100)), (10, 100));
        let meter = auth
            .verify_certificate(&subject("CN=meter", Some("meter")))
            .unwrap()
            .limits;
        assert_eq!(meter.or((10, 100)), (10, 4));
        let mut claims = good_claims();
        claims["limits"] = serde_json::json!({"max_connections": 3});
        assert_eq!(limits(&hs_token(&claims)).or((10, 100)), (3, 100));
        assert_eq!(limits(&hs_token(&good_claims())), UserLimits::default());
        claims["limits"] = serde_json::json!({"max_connections": -1});
        let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
        assert!(
            matches!(&err, AuthError::InvalidPermissions { claim, .. } if claim == "limits"),
            "{err:?}"
        );
        assert!(toml::from_str::<AuthConfig>(
            "[[tokens]]\ntoken = \"t\"\nuser = \"u\"\nlimits = { connections = 1 }"
        )
        .is_err());
    }

    #[test]
    fn certificate_entry_errors_name_the_entry_and_the_problem() {
        let err = |text: &str| {
            let config: AuthConfig = toml::from_str(text).unwrap();
            Authenticator::from_config(&config).unwrap_err().to_string()
        };
        assert_eq!(
            err("[[certificates]]\nsubject = \"\""),
            "auth.certificates[0]: subject must not be empty"
        );
        assert_eq!(
            err("[[certificates]]\nsubject = \"CN=a\"\n[[certificates]]\nsubject = \"CN=a\""),
            "auth.certificates[1]: subject `CN=a` repeats auth.certificates[0].subject"
        );
        assert_eq!(
            err("[[certificates]]\nsubject = \"CN=a\"\nuser = \"\""),
            "auth.certificates[0]: user must not be empty"
        );
        let bad = err("[[certificates]]\nsubject = \"CN=a\"\npermissions = { publish = { allow = [\"a/>/b\"] } }");
        assert!(
            bad.starts_with("auth.certificates[0]: (user `a`): "),
            "{bad}"
        );
        assert!(
            toml::from_str::<AuthConfig>("[[certificates]]\nsubject = \"CN=a\"\ncn = \"a\"")
                .is_err()
        );
    }

    #[test]
    fn static_tokens_come_before_jwts() {
        let mut config = static_config();
        config.jwt = Some(hs_config());
        let auth = Authenticator::from_config(&config).unwrap();
        assert_eq!(auth.verify("token-one", at(T0)).unwrap().user, "one");
        assert_eq!(
            auth.verify(&hs_token(&good_claims()), at(T0)).unwrap().user,
            "alice"
        );
        // Not JWT-shaped, with static tokens configured: an unknown static token.
        assert_eq!(
            auth.verify("nope", at(T0)).unwrap_err(),
            AuthError::UnknownToken
        );
        // Without static tokens, the same is a malformed JWT.
        let auth = with_jwt(hs_config());
        assert_eq!(
            auth.verify("nope", at(T0)).unwrap_err().code(),
            "malformed_token"
        );
    }

    // ---- JWT refusals, one test per reason ----

    #[test]
    fn hs256_token_verifies_with_permissions_and_expiry() {
        let auth = with_jwt(hs_config());
        let token = hs_token(&json!({
            "sub": "alice", "exp": T0 + 60,
            "permissions": {"subscribe": {"allow": ["obs"]}},
        }));
        let id = auth.verify(&token, at(T0)).unwrap();
        assert_eq!(id.user, "alice");
        assert_eq!(id.expires_at, Some(at(T0 + 60)));
        assert_eq!(id.remaining(at(T0 + 10)), Some(Duration::from_secs(50)));
        assert_eq!(id.remaining(at(T0 + 100)), Some(Duration::ZERO));
        assert!(id.permissions.subscribe("obs", None).is_allowed());
        assert!(!id.permissions.subscribe("other", None).is_allowed());
        // No permissions claim: authenticated, permitted nothing; no exp: never expires.
        let id = auth
            .verify(&hs_token(&json!({"sub": "bob"})), at(T0))
            .unwrap();
        assert_eq!(*id.permissions, Permissions::none());
        assert_eq!(id.expires_at, None);
    }

    #[test]
    fn bad_signature_is_refused() {
        let auth = with_jwt(hs_config());
        let token = hs_token(&good_claims());
        // Another payload under the original signature.
        let (_, rest) = token.split_once('.').unwrap();
        let (_, sig) = rest.split_once('.').unwrap();
        let forged = format!(
            "{}.{}.{sig}",
            hs_header(),
            b64(br#"{"sub":"mallory","exp":1700000060}"#)
        );
        assert_eq!(auth.verify(&forged, at(T0)), Err(AuthError::BadSignature));
        // Signed with another secret.
        let other = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &good_claims(),
            &EncodingKey::from_secret(b"another secret, also thirty-two bytes long"),
        )
        .unwrap();
        let err = auth.verify(&other, at(T0)).unwrap_err();
        assert_eq!(err, AuthError::BadSignature);
        assert_eq!(err.code(), "bad_signature");
    }

    #[test]
    fn expired_token_is_refused_from_exp_on_with_leeway() {
        let auth = with_jwt(hs_config());
        let token = hs_token(&good_claims());
        assert!(auth.verify(&token, at(T0 + 59)).is_ok());
        let err = auth.verify(&token, at(T0 + 60)).unwrap_err();
        assert_eq!(err, AuthError::Expired { exp: T0 + 60 });
        assert_eq!(err.code(), "token_expired");
        let auth = with_jwt(JwtConfig {
            leeway_secs: 5,
            ..hs_config()
        });
        let id = auth.verify(&token, at(T0 + 64)).unwrap();
        assert_eq!(id.expires_at, Some(at(T0 + 65)));
        assert!(auth.verify(&token, at(T0 + 65)).is_err());
    }

    /// An `exp` past what the clock can represent, validly signed, is a token that does not
    /// expire (it used to overflow adding to the epoch and panic the shard); a leeway past a
    /// day is refused when the config is loaded, naming the key.
    #[test]
    fn an_exp_beyond_the_clock_never_expires_and_a_huge_leeway_is_refused() {
        let auth = with_jwt(hs_config());
        for exp in [json!(1e20), json!(1e300), json!(u64::MAX)] {
            let token = hs_token(&json!({"sub": "alice", "exp": exp}));
            let id = auth
                .verify(&token, at(T0))
                .expect("a far-future exp verifies");
            assert_eq!(id.expires_at, None, "exp {exp}");
        }
        let config = AuthConfig {
            jwt: Some(JwtConfig {
                leeway_secs: u64::MAX,
                ..hs_config()
            }),
            ..AuthConfig::default()
        };
        let err = Authenticator::from_config_with(&config, |p| read_from(&[], p)).unwrap_err();
        assert!(matches!(
            err,
            AuthConfigError::LeewayTooLarge { value: u64::MAX }
        ));
        assert!(err.to_string().contains("auth.jwt.leeway_secs"), "{err}");
        let auth = with_jwt(JwtConfig {
            leeway_secs: MAX_LEEWAY_SECS,
            ..hs_config()
        });
        let token = hs_token(&json!({"sub": "alice", "exp": u64::MAX - 1}));
        assert_eq!(auth.verify(&token, at(T0)).unwrap().expires_at, None);
    }

    /// `require_exp` refuses a signed token without `exp` (after its signature verified) and
    /// lets one with any `exp` through; without it such a token never expires.
    #[test]
    fn with_require_exp_a_token_without_exp_is_refused_as_missing_exp() {
        let strict = with_jwt(JwtConfig {
            require_exp: true,
            ..hs_config()
        });
        let lax = with_jwt(hs_config());
        let no_exp = hs_token(&json!({"sub": "alice"}));
        let err = strict.verify(&no_exp, at(T0)).unwrap_err();
        assert_eq!(err, AuthError::MissingExp);
        assert_eq!(err.code(), "missing_exp");
        assert!(err.to_string().contains("require_exp"), "{err}");
        assert_eq!(lax.verify(&no_exp, at(T0)).unwrap().expires_at, None);
        let with_exp = hs_token(&json!({"sub": "alice", "exp": T0 + 60}));
        assert_eq!(
            strict.verify(&with_exp, at(T0)).unwrap().expires_at,
            Some(at(T0 + 60))
        );
        // A forged token is a bad signature first, whatever its claims lack.
        let forged = format!("{}x", &no_exp[..no_exp.len() - 1]);
        assert_ne!(
            strict.verify(&forged, at(T0)).unwrap_err(),
            AuthError::MissingExp
        );
        // The key is read from a config file.
        let config: AuthConfig = toml::from_str(&format!(
            "[jwt]\nalgorithm = \"HS256\"\nsecret = \"{SECRET}\"\nrequire_exp = true\n"
        ))
        .unwrap();
        assert!(config.jwt.unwrap().require_exp);
    }

    #[test]
    fn not_yet_valid_token_is_refused_until_nbf() {
        let auth = with_jwt(hs_config());
        let token = hs_token(&json!({"sub": "alice", "nbf": T0 + 10}));
        let err = auth.verify(&token, at(T0 + 9)).unwrap_err();
        assert_eq!(err, AuthError::NotYetValid { nbf: T0 + 10 });
        assert_eq!(err.code(), "token_not_yet_valid");
        assert!(auth.verify(&token, at(T0 + 10)).is_ok());
        let auth = with_jwt(JwtConfig {
            leeway_secs: 3,
            ..hs_config()
        });
        assert!(auth.verify(&token, at(T0 + 7)).is_ok());
        assert!(auth.verify(&token, at(T0 + 6)).is_err());
    }

    #[test]
    fn wrong_audience_is_refused() {
        let auth = with_jwt(JwtConfig {
            audience: Some("powerhub".into()),
            ..hs_config()
        });
        for aud in [json!("powerhub"), json!(["other", "powerhub"])] {
            let t = hs_token(&json!({"sub": "a", "aud": aud}));
            assert!(auth.verify(&t, at(T0)).is_ok(), "{aud}");
        }
        for aud in [
            Some(json!("other")),
            Some(json!(["x", "y"])),
            Some(json!([])),
            None,
        ] {
            let mut claims = json!({"sub": "a"});
            if let Some(aud) = &aud {
                claims["aud"] = aud.clone();
            }
            let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
            assert_eq!(
                err,
                AuthError::WrongAudience {
                    expected: Some("powerhub".into())
                },
                "{aud:?}"
            );
            assert_eq!(err.code(), "wrong_audience");
        }
        // A server configured with no audience refuses a token that names one.
        let auth = with_jwt(hs_config());
        let t = hs_token(&json!({"sub": "a", "aud": "someone-else"}));
        assert_eq!(
            auth.verify(&t, at(T0)).unwrap_err(),
            AuthError::WrongAudience { expected: None }
        );
        let t = hs_token(&json!({"sub": "a", "aud": 7}));
        assert_eq!(
            auth.verify(&t, at(T0)).unwrap_err().code(),
            "malformed_token"
        );
    }

    #[test]
    fn wrong_issuer_is_refused() {
        let auth = with_jwt(JwtConfig {
            issuer: Some("https://id.example".into()),
            ..hs_config()
        });
        let ok = hs_token(&json!({"sub": "a", "iss": "https://id.example"}));
        assert!(auth.verify(&ok, at(T0)).is_ok());
        for claims in [
            json!({"sub": "a", "iss": "https://evil.example"}),
            json!({"sub": "a"}),
        ] {
            let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
            assert_eq!(
                err,
                AuthError::WrongIssuer {
                    expected: "https://id.example".into()
                }
            );
            assert_eq!(err.code(), "wrong_issuer");
        }
    }

    #[test]
    fn malformed_tokens_are_refused_naming_the_part() {
        let auth = with_jwt(hs_config());
        let part = |t: &str| match auth.verify(t, at(T0)) {
            Err(AuthError::Malformed { part, .. }) => part,
            other => panic!("{t}: {other:?}"),
        };
        let payload = b64(br#"{"sub":"a"}"#);
        assert_eq!(part("only.two"), TokenPart::Token);
        assert_eq!(part("a.b.c.d"), TokenPart::Token);
        assert_eq!(part(&"x".repeat(MAX_TOKEN_BYTES + 1)), TokenPart::Token);
        // Header: not base64url, not JSON, no alg.
        assert_eq!(part(&format!("!!!.{payload}.c2ln")), TokenPart::Header);
        assert_eq!(
            part(&format!("{}.{payload}.c2ln", b64(b"not json"))),
            TokenPart::Header
        );
        assert_eq!(
            part(&format!("{}.{payload}.c2ln", b64(b"{}"))),
            TokenPart::Header
        );
        assert_eq!(
            part(&format!("{}.{payload}.c2ln", b64(br#"{"alg":5}"#))),
            TokenPart::Header
        );
        // Critical extensions (RFC 7515 §4.1.11): refused from the header, before the signature.
        let signed = hs_token(&json!({"sub": "a"}));
        let (_, rest) = signed.split_once('.').unwrap();
        let with_crit = format!("{}.{rest}", b64(br#"{"alg":"HS256","crit":["exp"]}"#));
        assert_eq!(part(&with_crit), TokenPart::Header);
        // Signature: not base64url.
        assert_eq!(
            part(&format!("{}.{payload}.@@@", hs_header())),
            TokenPart::Signature
        );
        // Payload, correctly signed: not base64url, not JSON, not an object, a string `exp`.
        assert_eq!(
            part(&hs_signed_raw(&hs_header(), "%%%")),
            TokenPart::Payload
        );
        assert_eq!(
            part(&hs_signed_raw(&hs_header(), &b64(b"{not json"))),
            TokenPart::Payload
        );
        assert_eq!(
            part(&hs_signed_raw(&hs_header(), &b64(b"[1,2]"))),
            TokenPart::Payload
        );
        for claims in [
            json!({"sub": "a", "exp": "1700000060"}),
            json!({"sub": "a", "nbf": -1}),
            json!({"sub": 42}),
            json!({"sub": "a", "iss": ["x"]}),
            json!({"sub": "a", "iat": "x"}),
            json!({"sub": "a", "iat": {}}),
            json!({"sub": "a", "jti": 5}),
            json!({"sub": "a", "jti": [1]}),
        ] {
            assert_eq!(part(&hs_token(&claims)), TokenPart::Payload, "{claims}");
        }
        let err = auth.verify("only.two", at(T0)).unwrap_err();
        assert_eq!(err.code(), "malformed_token");
    }

    #[test]
    fn alg_none_and_other_algorithms_are_refused() {
        let auth = with_jwt(hs_config());
        let payload = b64(serde_json::to_string(&good_claims()).unwrap().as_bytes());
        for header in [
            r#"{"alg":"none"}"#,
            r#"{"alg":"None","typ":"JWT"}"#,
            r#"{"alg":"NONE"}"#,
        ] {
            for sig in ["", "c2ln"] {
                let t = format!("{}.{payload}.{sig}", b64(header.as_bytes()));
                let err = auth.verify(&t, at(T0)).unwrap_err();
                assert_eq!(err, AuthError::AlgNone, "{header} {sig:?}");
                assert_eq!(err.code(), "alg_none");
            }
        }
        // HS512 (a real HMAC token with the right secret) and RS256 are not the configured HS256.
        let hs512 = jsonwebtoken::encode(
            &Header::new(Algorithm::HS512),
            &good_claims(),
            &EncodingKey::from_secret(SECRET.as_bytes()),
        )
        .unwrap();
        let err = auth.verify(&hs512, at(T0)).unwrap_err();
        assert_eq!(
            err,
            AuthError::AlgorithmNotAllowed {
                alg: "HS512".into(),
                expected: JwtAlgorithm::Hs256
            }
        );
        assert_eq!(err.code(), "algorithm_not_allowed");
        // The classic confusion: an RS256 server handed an HS256 token "signed" with the PEM.
        let auth = with_jwt_files(rs_config(), &[("rsa.pub.pem", RSA_PUBLIC)]);
        let confused = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &good_claims(),
            &EncodingKey::from_secret(RSA_PUBLIC.as_bytes()),
        )
        .unwrap();
        assert_eq!(
            auth.verify(&confused, at(T0)).unwrap_err().code(),
            "algorithm_not_allowed"
        );
    }

    #[test]
    fn missing_sub_is_refused() {
        let auth = with_jwt(hs_config());
        for claims in [json!({"exp": T0 + 60}), json!({"sub": ""})] {
            let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
            assert_eq!(err, AuthError::MissingSub);
            assert_eq!(err.code(), "missing_sub");
        }
    }

    #[test]
    fn invalid_permissions_claim_is_refused() {
        let auth = with_jwt(JwtConfig {
            permissions_claim: "perms".into(),
            ..hs_config()
        });
        for perms in [
            json!("everything"),
            json!({"read": {}}),
            json!({"publish": {"allow": ["x*"]}}),
            // Fields by position: not a shape of the claim.
            json!([{"allow": [">"]}]),
            json!({"subscribe": [[">"], []]}),
        ] {
            let t = hs_token(&json!({"sub": "a", "perms": perms}));
            let err = auth.verify(&t, at(T0)).unwrap_err();
            assert!(
                matches!(&err, AuthError::InvalidPermissions { claim, .. } if claim == "perms"),
                "{err:?}"
            );
            assert_eq!(err.code(), "invalid_permissions");
        }
        // The default claim name is ignored when another is configured.
        let t = hs_token(&json!({"sub": "a", "permissions": "whatever"}));
        assert!(auth.verify(&t, at(T0)).is_ok());
        // Rates and limits are objects too, never read field by field from an array.
        for claims in [
            json!({"sub": "a", "rates": [1]}),
            json!({"sub": "a", "limits": [1]}),
        ] {
            let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
            assert!(
                matches!(err, AuthError::InvalidPermissions { .. }),
                "{err:?}"
            );
            assert!(err.to_string().contains("a table of named fields"), "{err}");
        }
        // What an error quotes of the claim is cut as every echo of client text is.
        let long = "A".repeat(3000);
        for claims in [
            json!({"sub": "a", "perms": long}),
            json!({"sub": "a", "perms": {"publish": {"allow": [long]}}}),
            json!({"sub": "a", "rates": long}),
            json!({"sub": "a", "limits": {long.as_str(): 1}}),
        ] {
            let err = auth.verify(&hs_token(&claims), at(T0)).unwrap_err();
            let text = err.to_string();
            assert!(text.len() < 128 + 64, "{} bytes: {text}", text.len());
        }
    }

    #[test]
    fn authenticator_and_identity_can_be_shared_between_shards() {
        fn shared<T: Send + Sync>() {}
        shared::<Authenticator>();
        shared::<Identity>();
        shared::<AuthConfig>();
    }

    #[test]
    fn every_code_is_listed_and_distinct() {
        let mut codes = AuthError::CODES.to_vec();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), AuthError::CODES.len());
        for e in [
            AuthError::UnknownToken,
            AuthError::BadSignature,
            AuthError::Expired { exp: 0 },
            AuthError::NotYetValid { nbf: 0 },
            AuthError::WrongAudience { expected: None },
            AuthError::WrongIssuer {
                expected: String::new(),
            },
            malformed(TokenPart::Token, ""),
            AuthError::AlgNone,
            AuthError::AlgorithmNotAllowed {
                alg: String::new(),
                expected: JwtAlgorithm::Hs256,
            },
            AuthError::MissingSub,
            AuthError::InvalidPermissions {
                claim: String::new(),
                reason: String::new(),
            },
        ] {
            assert!(AuthError::CODES.contains(&e.code()), "{e:?}");
        }
    }

    // ---- keys: HS256 secrets, RS256 and ES256 public keys ----

    fn rs_config() -> JwtConfig {
        JwtConfig {
            algorithm: JwtAlgorithm::Rs256,
            secret: None,
            public_key_file: Some("rsa.pub.pem".into()),
            ..hs_config()
        }
    }

    fn es_config() -> JwtConfig {
        JwtConfig {
            algorithm: JwtAlgorithm::Es256,
            secret: None,
            public_key_file: Some("ec.pub.pem".into()),
            ..hs_config()
        }
    }

    fn rs_encoding_key() -> EncodingKey {
        use rustls::pki_types::PrivatePkcs1KeyDer;
        let der = PrivatePkcs1KeyDer::from_pem_slice(RSA_PRIVATE.as_bytes()).unwrap();
        EncodingKey::from_rsa_der(der.secret_pkcs1_der())
    }

    #[test]
    fn rs256_verifies_with_the_public_key_and_refuses_another() {
        let token = jsonwebtoken::encode(
            &Header::new(Algorithm::RS256),
            &json!({"sub": "rsa-user", "exp": T0 + 60}),
            &rs_encoding_key(),
        )
        .unwrap();
        let auth = with_jwt_files(rs_config(), &[("rsa.pub.pem", RSA_PUBLIC)]);
        assert_eq!(auth.verify(&token, at(T0)).unwrap().user, "rsa-user");
        assert_eq!(
            auth.verify(&token, at(T0 + 60)).unwrap_err(),
            AuthError::Expired { exp: T0 + 60 }
        );
        let other = with_jwt_files(rs_config(), &[("rsa.pub.pem", RSA_OTHER_PUBLIC)]);
        assert_eq!(other.verify(&token, at(T0)), Err(AuthError::BadSignature));
    }

    #[test]
    fn es256_verifies_with_the_public_key_and_refuses_another() {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let token = jsonwebtoken::encode(
            &Header::new(Algorithm::ES256),
            &json!({"sub": "ec-user"}),
            &EncodingKey::from_ec_der(&key.serialize_der()),
        )
        .unwrap();
        let public = key.public_key_pem();
        let auth = with_jwt_files(es_config(), &[("ec.pub.pem", &public)]);
        assert_eq!(auth.verify(&token, at(T0)).unwrap().user, "ec-user");
        // The key inside a certificate works as well.
        let cert = rcgen::CertificateParams::new(vec!["issuer.example".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap()
            .pem();
        let auth = with_jwt_files(es_config(), &[("ec.pub.pem", &cert)]);
        assert!(auth.verify(&token, at(T0)).is_ok());
        let other = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let auth = with_jwt_files(es_config(), &[("ec.pub.pem", &other.public_key_pem())]);
        assert_eq!(auth.verify(&token, at(T0)), Err(AuthError::BadSignature));
        // An ES256 signature of the wrong length is a bad signature, not a crash.
        let (message, sig) = token.rsplit_once('.').unwrap();
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(sig)
            .unwrap();
        let short = format!("{message}.{}", b64(&sig[..sig.len() - 3]));
        assert_eq!(
            with_jwt_files(es_config(), &[("ec.pub.pem", &public)]).verify(&short, at(T0)),
            Err(AuthError::BadSignature)
        );
    }

    #[test]
    fn key_configuration_errors_name_the_key_or_file() {
        let build = |jwt: JwtConfig, files: &[(&str, &str)]| {
            Authenticator::from_config_with(
                &AuthConfig {
                    jwt: Some(jwt),
                    ..AuthConfig::default()
                },
                |p| read_from(files, p),
            )
            .unwrap_err()
        };
        let err = build(
            JwtConfig {
                secret: None,
                ..hs_config()
            },
            &[],
        );
        assert!(matches!(
            err,
            AuthConfigError::MissingKey {
                algorithm: JwtAlgorithm::Hs256,
                ..
            }
        ));
        let err = build(
            JwtConfig {
                secret: Some("short".into()),
                ..hs_config()
            },
            &[],
        );
        assert!(matches!(err, AuthConfigError::SecretTooShort { len: 5 }));
        let err = build(
            JwtConfig {
                secret_file: Some("s".into()),
                ..hs_config()
            },
            &[],
        );
        assert!(matches!(
            err,
            AuthConfigError::ConflictingKey { key: "secret", .. }
        ));
        let err = build(
            JwtConfig {
                public_key_file: Some("k".into()),
                ..hs_config()
            },
            &[],
        );
        assert!(matches!(
            err,
            AuthConfigError::ConflictingKey {
                key: "public_key_file",
                ..
            }
        ));
        let err = build(
            JwtConfig {
                secret: Some(SECRET.into()),
                ..rs_config()
            },
            &[],
        );
        assert!(matches!(
            err,
            AuthConfigError::ConflictingKey { key: "secret", .. }
        ));
        let err = build(
            JwtConfig {
                public_key_file: None,
                ..rs_config()
            },
            &[],
        );
        assert!(matches!(
            err,
            AuthConfigError::MissingKey {
                algorithm: JwtAlgorithm::Rs256,
                ..
            }
        ));
        let err = build(rs_config(), &[]);
        assert!(
            matches!(&err, AuthConfigError::Read { path, .. } if path == Path::new("rsa.pub.pem"))
        );
        assert!(err.to_string().contains("rsa.pub.pem"), "{err}");
        let key_reason = |jwt, files: &[(&str, &str)]| match build(jwt, files) {
            AuthConfigError::Key { reason, .. } => reason,
            other => panic!("{other:?}"),
        };
        let r = key_reason(rs_config(), &[("rsa.pub.pem", "not a pem at all")]);
        assert!(r.contains("no PUBLIC KEY or CERTIFICATE"), "{r}");
        let r = key_reason(rs_config(), &[("rsa.pub.pem", RSA_SHORT_PUBLIC)]);
        assert!(r.contains("1024 bits"), "{r}");
        let ec = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
        let r = key_reason(rs_config(), &[("rsa.pub.pem", &ec.public_key_pem())]);
        assert!(r.contains("not an RSA public key"), "{r}");
        assert!(r.contains("the file holds an EC key on P-256"), "{r}");
        let r = key_reason(es_config(), &[("ec.pub.pem", RSA_PUBLIC)]);
        assert!(r.contains("not a P-256 public key"), "{r}");
        assert!(r.contains("the file holds an RSA key"), "{r}");
        let p384 = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let r = key_reason(es_config(), &[("ec.pub.pem", &p384.public_key_pem())]);
        assert!(r.contains("the file holds an EC key on P-384"), "{r}");
        // An HS256 secret from a file, its trailing line break dropped.
        let secret_file = format!("{SECRET}\n");
        let auth = with_jwt_files(
            JwtConfig {
                secret: None,
                secret_file: Some("secret".into()),
                ..hs_config()
            },
            &[("secret", &secret_file)],
        );
        assert!(auth.verify(&hs_token(&good_claims()), at(T0)).is_ok());
    }
}
