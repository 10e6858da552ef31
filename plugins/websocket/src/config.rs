//! The WebSocket transport's configuration and its validation.

use std::time::Duration;

use serde::Deserialize;

/// Configuration of the WebSocket transport.
///
/// Deserializes from a config file section (unknown fields are rejected, missing fields take
/// their defaults) or is built in code from [`WebSocketConfig::default`] and the `with_*`
/// methods. [`WebSocketFactory::new`](crate::WebSocketFactory::new) validates it.
///
/// The byte limits apply together with the runtime's [`ProtocolLimits`]: a connection enforces
/// the tighter of the two.
///
/// [`ProtocolLimits`]: powerhub_plugin::ProtocolLimits
///
/// ```
/// use std::time::Duration;
/// use powerhub_websocket::WebSocketConfig;
///
/// let config = WebSocketConfig::default()
///     .with_path("/ws")
///     .with_allowed_origins(["http://localhost:8080"])
///     .with_handshake_timeout(Duration::from_secs(5));
/// assert!(config.validate().is_ok());
/// assert_eq!(config.path, "/ws");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
#[non_exhaustive]
pub struct WebSocketConfig {
    /// Origins (`scheme://host[:port]`, compared without regard to ASCII case, or `null`, the
    /// origin of sandboxed frames and `file:` pages) whose browsers may connect. Empty, with
    /// [`same_host_origin`](Self::same_host_origin) off, accepts any origin, and requests
    /// without an `Origin` header. Otherwise a request whose `Origin` is not listed (nor the
    /// request's own host, with `same_host_origin`) is rejected with 403, and so is one without
    /// `Origin` unless [`allow_missing_origin`](Self::allow_missing_origin) is on. `null` is
    /// accepted only when listed.
    pub allowed_origins: Vec<String>,
    /// Accept an `Origin` whose `host[:port]` is the request's `Host` header (a page served by
    /// this listener's own address), whatever its scheme. Default `false`.
    pub same_host_origin: bool,
    /// Accept requests without an `Origin` header while origins are restricted. Browsers always
    /// send one on a WebSocket upgrade, so a request without it comes from a program (which
    /// the origin check cannot hold back anyway: it can send any `Origin`). Default `false`.
    pub allow_missing_origin: bool,
    /// The request path (without query) that accepts upgrades and serves the page. Default `/`.
    pub path: String,
    /// Largest opening handshake (request line and headers), in bytes; larger gets 431.
    /// Default 8 KiB.
    pub max_handshake_bytes: usize,
    /// How long a connection may take to complete its opening handshake. The runtime enforces
    /// it (the codec has no clock). Written `handshake_timeout_ms` in a config file.
    /// Default 10 s.
    #[serde(rename = "handshake_timeout_ms", deserialize_with = "millis")]
    pub handshake_timeout: Duration,
    /// Largest payload of one inbound frame, in bytes; larger closes with 1009. Default 1 MiB.
    pub max_frame_bytes: usize,
    /// Largest inbound message (all its fragments), in bytes; larger closes with 1009.
    /// Default 1 MiB.
    pub max_message_bytes: usize,
    /// Whether a plain `GET` of [`path`](Self::path) returns the built-in web page. Default
    /// `false` (production); the server's embedded development config turns it on.
    pub serve_page: bool,
}

impl Default for WebSocketConfig {
    fn default() -> Self {
        WebSocketConfig {
            allowed_origins: Vec::new(),
            same_host_origin: false,
            allow_missing_origin: false,
            path: "/".to_owned(),
            max_handshake_bytes: 8 << 10,
            handshake_timeout: Duration::from_secs(10),
            max_frame_bytes: 1 << 20,
            max_message_bytes: 1 << 20,
            serve_page: false,
        }
    }
}

fn millis<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    u64::deserialize(d).map(Duration::from_millis)
}

/// A configuration value that cannot work; the variant names the option.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `path` is not an absolute request path.
    #[error("websocket option `path` = {path:?} is invalid: {reason}")]
    InvalidPath {
        /// The value given.
        path: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// An entry of `allowed_origins` is not a `scheme://host[:port]` origin.
    #[error("websocket option `allowed_origins` entry {origin:?} is invalid: {reason}")]
    InvalidOrigin {
        /// The value given.
        origin: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A size or time limit is zero.
    #[error("websocket option `{option}` must be greater than zero")]
    Zero {
        /// The option's name.
        option: &'static str,
    },
}

impl WebSocketConfig {
    /// The same configuration accepting upgrades (and serving the page) on `path`.
    pub fn with_path(mut self, path: impl Into<String>) -> Self {
        self.path = path.into();
        self
    }

    /// The same configuration also accepting origins on the request's own host (see
    /// [`same_host_origin`](Self::same_host_origin)).
    pub fn with_same_host_origin(mut self, on: bool) -> Self {
        self.same_host_origin = on;
        self
    }

    /// The same configuration accepting requests without `Origin` while origins are restricted
    /// (see [`allow_missing_origin`](Self::allow_missing_origin)).
    pub fn with_allow_missing_origin(mut self, on: bool) -> Self {
        self.allow_missing_origin = on;
        self
    }

    /// Whether the `Origin` header is checked at all.
    pub fn restricts_origins(&self) -> bool {
        !self.allowed_origins.is_empty() || self.same_host_origin
    }

    /// The same configuration accepting only the given origins (empty: any).
    pub fn with_allowed_origins<I, S>(mut self, origins: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.allowed_origins = origins.into_iter().map(Into::into).collect();
        self
    }

    /// The same configuration with the given handshake size limit.
    pub fn with_max_handshake_bytes(mut self, bytes: usize) -> Self {
        self.max_handshake_bytes = bytes;
        self
    }

    /// The same configuration with the given handshake time limit.
    pub fn with_handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// The same configuration with the given frame payload limit.
    pub fn with_max_frame_bytes(mut self, bytes: usize) -> Self {
        self.max_frame_bytes = bytes;
        self
    }

    /// The same configuration with the given message size limit.
    pub fn with_max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// The same configuration, serving the web page or not.
    pub fn with_serve_page(mut self, serve: bool) -> Self {
        self.serve_page = serve;
        self
    }

    /// Checks every option; the error names the first one that cannot work.
    ///
    /// ```
    /// use powerhub_websocket::{ConfigError, WebSocketConfig};
    ///
    /// let err = WebSocketConfig::default().with_max_frame_bytes(0).validate().unwrap_err();
    /// assert_eq!(err, ConfigError::Zero { option: "max_frame_bytes" });
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        let path_error = |reason| ConfigError::InvalidPath {
            path: self.path.clone(),
            reason,
        };
        if !self.path.starts_with('/') {
            return Err(path_error("it must start with `/`"));
        }
        if self
            .path
            .bytes()
            .any(|b| b <= b' ' || b == 0x7f || b == b'?' || b == b'#')
        {
            return Err(path_error(
                "it must not contain spaces, control characters, `?` or `#`",
            ));
        }
        for origin in &self.allowed_origins {
            check_origin(origin)?;
        }
        for (option, value) in [
            ("max_handshake_bytes", self.max_handshake_bytes),
            ("max_frame_bytes", self.max_frame_bytes),
            ("max_message_bytes", self.max_message_bytes),
        ] {
            if value == 0 {
                return Err(ConfigError::Zero { option });
            }
        }
        if self.handshake_timeout.is_zero() {
            return Err(ConfigError::Zero {
                option: "handshake_timeout_ms",
            });
        }
        Ok(())
    }
}

fn check_origin(origin: &str) -> Result<(), ConfigError> {
    let error = |reason| ConfigError::InvalidOrigin {
        origin: origin.to_owned(),
        reason,
    };
    if origin == "null" {
        return Ok(());
    }
    let Some((scheme, rest)) = origin.split_once("://") else {
        return Err(error("expected `scheme://host[:port]` or `null`"));
    };
    if scheme.is_empty()
        || !scheme
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b))
    {
        return Err(error(
            "the scheme is empty or has characters a scheme cannot have",
        ));
    }
    if rest.is_empty() {
        return Err(error("the host is empty"));
    }
    if rest
        .bytes()
        .any(|b| b <= b' ' || b == 0x7f || b == b'/' || b == b'?' || b == b'#')
    {
        return Err(error(
            "an origin has no path, query, spaces or control characters",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid_and_serves_no_page() {
        let config = WebSocketConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert!(!config.serve_page);
        assert_eq!(config.path, "/");
    }

    #[test]
    fn config_rejects_relative_path_naming_the_option() {
        let err = WebSocketConfig::default()
            .with_path("ws")
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("`path`"), "{err}");
        let err = WebSocketConfig::default()
            .with_path("/a?b")
            .validate()
            .unwrap_err();
        assert!(matches!(err, ConfigError::InvalidPath { .. }));
    }

    #[test]
    fn config_rejects_origin_with_path() {
        let err = WebSocketConfig::default()
            .with_allowed_origins(["http://example.test/app"])
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("allowed_origins"), "{err}");
        let err = WebSocketConfig::default()
            .with_allowed_origins(["example.test"])
            .validate();
        assert!(matches!(err, Err(ConfigError::InvalidOrigin { .. })));
    }

    #[test]
    fn config_rejects_zero_limits_naming_the_option() {
        for (config, option) in [
            (
                WebSocketConfig::default().with_max_handshake_bytes(0),
                "max_handshake_bytes",
            ),
            (
                WebSocketConfig::default().with_max_message_bytes(0),
                "max_message_bytes",
            ),
            (
                WebSocketConfig::default().with_handshake_timeout(Duration::ZERO),
                "handshake_timeout_ms",
            ),
        ] {
            assert_eq!(config.validate(), Err(ConfigError::Zero { option }));
        }
    }

    #[test]
    fn config_deserializes_with_defaults_and_rejects_unknown_fields() {
        let config: WebSocketConfig =
            toml::from_str("path = \"/ws\"\nhandshake_timeout_ms = 2500\nserve_page = true\n")
                .unwrap();
        assert_eq!(config.path, "/ws");
        assert_eq!(config.handshake_timeout, Duration::from_millis(2500));
        assert!(config.serve_page);
        assert_eq!(
            config.max_frame_bytes,
            WebSocketConfig::default().max_frame_bytes
        );

        let err = toml::from_str::<WebSocketConfig>("max_frame_size = 10\n").unwrap_err();
        assert!(err.to_string().contains("max_frame_size"), "{err}");
    }
}
