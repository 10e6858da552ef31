//! The engine's configuration: TOML, every key optional, unknown keys rejected.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::security::auth::AuthConfig;

/// The embedded default configuration file (`powerhub serve --print-default-config`).
pub const DEFAULT_CONFIG: &str = include_str!("default.toml");

/// The smallest `limits.max_outbox_bytes` the server accepts.
const MIN_OUTBOX_BYTES: usize = 64 << 10;

/// Why a configuration was refused. Every variant names the key or value at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The TOML did not parse, or named an unknown key, or a value of the wrong type. The message
    /// from the parser names the key and the line.
    #[error("invalid configuration{}: {message}", source_name.as_deref().map(|s| format!(" in {s}")).unwrap_or_default())]
    Parse {
        /// The file the text came from, if any.
        source_name: Option<String>,
        /// The parser's message (key, line and column).
        message: String,
    },
    /// A value parsed but is out of its allowed range.
    #[error("invalid configuration value `{key}` = {value}: {reason}")]
    Invalid {
        /// The key, dotted (`limits.max_connections`, `listener[1].address`).
        key: String,
        /// The value given.
        value: String,
        /// What is allowed.
        reason: String,
    },
    /// The configuration file could not be read.
    #[error("cannot read configuration file {path}: {source}")]
    Read {
        /// The path.
        path: String,
        /// The error.
        source: std::io::Error,
    },
}

/// Which IO backend the shards run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum BackendChoice {
    /// io_uring when the kernel allows it (probed once at start), epoll otherwise.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// io_uring; if the kernel refuses it the engine logs why and runs epoll.
    #[serde(rename = "io_uring")]
    IoUring,
    /// epoll.
    #[serde(rename = "epoll")]
    Epoll,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(BackendChoice::IoUring),
            "epoll" => Ok(BackendChoice::Epoll),
            other => Err(format!(
                "unknown backend `{other}` (expected auto, io_uring or epoll)"
            )),
        }
    }
}

/// The environment variable that forces a backend: `POWERHUB_BACKEND=epoll`.
pub const BACKEND_ENV: &str = "POWERHUB_BACKEND";

/// The `[engine]` section.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSection {
    /// Worker threads; 0 = one per core.
    pub shards: usize,
    /// IO backend.
    pub backend: BackendChoice,
    /// Graceful shutdown deadline for connections, in milliseconds.
    pub shutdown_timeout_ms: u64,
    /// How often the hub's and the engine's counters are published to the `$stats` stream
    /// (while it has subscribers), in milliseconds; 0 = never.
    pub stats_interval_ms: u64,
    /// How long the engine's own hub gathers publications before a delivery turn to its
    /// library subscribers, in microseconds (`HubOptions::batch_delay`); 0 = a turn per wake-up
    /// of its drain thread.
    pub hub_batch_delay_us: u64,
    /// After a pass of a busy shard whose sends were small (under [`SMALL_SEND_BYTES`] on
    /// average), that shard's next fan-out waits until this many microseconds after those
    /// sends, so that publications arriving meanwhile leave as one larger segment per
    /// connection instead of many small ones; 0 = never wait. Per shard. A shard is busy when
    /// its thread has lately spent at least half its time on the CPU (until that falls under
    /// 35 %) and the pass began within half this gap of its previous sends.
    pub turn_gap_us: u64,
}

/// Largest accepted `engine.hub_batch_delay_us` (100 ms).
pub const MAX_HUB_BATCH_DELAY_US: u64 = 100_000;

/// Default `engine.turn_gap_us`.
pub const DEFAULT_TURN_GAP_US: u64 = 400;

/// Largest accepted `engine.turn_gap_us` (10 ms).
pub const MAX_TURN_GAP_US: u64 = 10_000;

/// A pass whose sends averaged fewer bytes than this is followed by `engine.turn_gap_us`.
pub const SMALL_SEND_BYTES: usize = 16 << 10;

impl EngineSection {
    /// `hub_batch_delay_us` as a duration.
    pub fn hub_batch_delay(&self) -> Duration {
        Duration::from_micros(self.hub_batch_delay_us)
    }

    /// `turn_gap_us` as a duration.
    pub fn turn_gap(&self) -> Duration {
        Duration::from_micros(self.turn_gap_us)
    }
}

impl Default for EngineSection {
    fn default() -> Self {
        EngineSection {
            shards: 0,
            backend: BackendChoice::Auto,
            shutdown_timeout_ms: 5000,
            stats_interval_ms: 1000,
            hub_batch_delay_us: 0,
            turn_gap_us: DEFAULT_TURN_GAP_US,
        }
    }
}

/// The `[limits]` section: every bound the engine enforces. Defaults are documented in
/// `docs/config.md` and in the embedded default config.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Open connections across all listeners.
    pub max_connections: usize,
    /// Largest inbound message, in bytes.
    pub max_message_bytes: usize,
    /// Largest opening handshake, in bytes.
    pub max_handshake_bytes: usize,
    /// Subscriptions per connection.
    pub max_subscriptions_per_connection: usize,
    /// Deepest nesting of arrays and objects in an inbound JSON message (the command object is
    /// depth 1); a deeper message gets a `limit_exceeded` error naming this limit.
    pub max_json_depth: usize,
    /// Unsent bytes above which deliveries to a connection are back-pressured.
    pub backpressure_bytes: usize,
    /// Unsent bytes at which the connection is closed with an error.
    pub max_outbox_bytes: usize,
    /// First-message deadline, in milliseconds: a connection that has not completed its
    /// protocol's handshake and sent one complete message by then is closed with an error naming
    /// this key. Written `handshake_timeout_ms` before it covered the first message too (that
    /// name is still accepted).
    #[serde(alias = "handshake_timeout_ms")]
    pub first_message_timeout_ms: u64,
    /// Idle deadline (no inbound bytes), in milliseconds; 0 = none.
    pub idle_timeout_ms: u64,
    /// How long a connection whose commands are held back (its unsent output past a quarter of
    /// `max_outbox_bytes`) may read none of its output, in milliseconds, before its commands are
    /// handled again (and it is closed at `max_outbox_bytes` if it still reads nothing).
    pub input_hold_timeout_ms: u64,
    /// How long a connection past `max_outbox_bytes`, its socket refusing writes and nothing
    /// more sent to it, may take nothing, in milliseconds, before it is closed with an error
    /// naming `max_outbox_bytes` (as NATS's `write_deadline` closes a stalled client).
    pub stall_timeout_ms: u64,
    /// With `[auth]`: the most bytes of one unfinished message a connection that has not
    /// authenticated may hold; past it the connection is closed with an error naming this key.
    pub max_unauthenticated_message_bytes: usize,
    /// Publishes per second per connection (a token bucket of one second's worth); a publish
    /// past it gets a `limit_exceeded` error naming this key. 0 = no limit.
    pub publish_messages_per_second: u64,
    /// Published message bytes per second per connection, as above. 0 = no limit.
    pub publish_bytes_per_second: u64,
    /// Refused publishes in a row after which the connection is closed; 0 = never.
    pub publish_violations_before_close: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 10_000,
            max_message_bytes: 16 << 20,
            max_handshake_bytes: 8 << 10,
            max_subscriptions_per_connection: 256,
            max_json_depth: crate::protocol::DEFAULT_MAX_JSON_DEPTH,
            backpressure_bytes: 8 << 20,
            max_outbox_bytes: 32 << 20,
            first_message_timeout_ms: DEFAULT_FIRST_MESSAGE_TIMEOUT_MS,
            idle_timeout_ms: 300_000,
            input_hold_timeout_ms: crate::push::INPUT_WAIT.as_millis() as u64,
            stall_timeout_ms: crate::push::STALL_WAIT.as_millis() as u64,
            max_unauthenticated_message_bytes: crate::push::MAX_UNAUTHENTICATED_MESSAGE_BYTES,
            publish_messages_per_second: 0,
            publish_bytes_per_second: 0,
            publish_violations_before_close: 0,
        }
    }
}

/// The largest config file read, in bytes.
const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Default `limits.first_message_timeout_ms`: 5 s (NATS closes a client that has not sent its
/// `CONNECT` after 2 s).
pub const DEFAULT_FIRST_MESSAGE_TIMEOUT_MS: u64 = 5_000;

impl Limits {
    /// The first-message deadline.
    pub fn first_message_timeout(&self) -> Duration {
        Duration::from_millis(self.first_message_timeout_ms)
    }

    /// [`first_message_timeout`](Self::first_message_timeout) under its former name.
    pub fn handshake_timeout(&self) -> Duration {
        self.first_message_timeout()
    }

    /// The idle deadline, if any.
    pub fn idle_timeout(&self) -> Option<Duration> {
        (self.idle_timeout_ms > 0).then(|| Duration::from_millis(self.idle_timeout_ms))
    }
}

/// A subscription's slow-consumer policy, as the config names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum SlowConsumerChoice {
    /// Discard the oldest queued message.
    #[default]
    #[serde(rename = "drop-oldest")]
    DropOldest,
    /// Refuse the incoming message.
    #[serde(rename = "drop-newest")]
    DropNewest,
    /// Close the subscription (and its connection).
    #[serde(rename = "disconnect")]
    Disconnect,
}

/// The `[subscriptions]` section: hub options of every push subscription.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SubscriptionsSection {
    /// Queue length per subscription.
    pub max_queue: usize,
    /// Policy when the queue is full.
    pub slow_consumer: SlowConsumerChoice,
    /// Most messages per delivery.
    pub max_batch: usize,
}

impl Default for SubscriptionsSection {
    fn default() -> Self {
        SubscriptionsSection {
            max_queue: 4096,
            slow_consumer: SlowConsumerChoice::DropOldest,
            max_batch: 64,
        }
    }
}

/// The `[outbox]` section: the push-stream rules of each connection's outbox.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxSection {
    /// Unsent bytes above which uncorrelated `drop_types` messages become `frames_dropped`.
    pub high_water_bytes: usize,
    /// Keepalive ping interval, in milliseconds.
    pub keepalive_interval_ms: u64,
    /// Liveness timeout (no pong, no drain progress), in milliseconds.
    pub liveness_timeout_ms: u64,
    /// Types coalesced per slot while a connection is paused.
    pub coalesce_types: Vec<String>,
    /// Types replaced by `frames_dropped` above `high_water_bytes`.
    pub drop_types: Vec<String>,
}

impl Default for OutboxSection {
    fn default() -> Self {
        OutboxSection {
            high_water_bytes: 8 << 20,
            keepalive_interval_ms: 15_000,
            liveness_timeout_ms: 45_000,
            coalesce_types: vec!["screenshot_update".into(), "hierarchy_update".into()],
            drop_types: vec!["screenshot_update".into()],
        }
    }
}

/// The longest Unix socket path a listener may bind: `sun_path` holds 108 bytes with the
/// terminating NUL.
const MAX_UNIX_PATH: usize = 107;

/// One `[[listener]]`: a registered protocol on a TCP address or a Unix socket path.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerConfig {
    /// The registered protocol name (`ndjson`, `frame`, `websocket`, or a custom one).
    pub protocol: String,
    /// A TCP address, e.g. `127.0.0.1:7400` (port 0 picks a free port).
    #[serde(default)]
    pub address: Option<String>,
    /// A Unix socket path.
    #[serde(default)]
    pub path: Option<PathBuf>,
    /// The browser origins a WebSocket listener accepts (`scheme://host[:port]`, `null` for
    /// sandboxed and `file:` pages, or `"*"` for any). Requests without an `Origin` header
    /// (programs, not browsers) are accepted. When not set: any origin while authentication is
    /// off; the listener's own host (the request's `Host`) once an `[auth]` section is
    /// configured. Ignored by protocols without origins.
    #[serde(default)]
    pub allowed_origins: Option<Vec<String>>,
    /// Whether a WebSocket listener answers a plain `GET` of its path with the live web page
    /// (`true`, what `powerhub serve` does when the key is absent) or with HTTP 426 Upgrade
    /// Required (`false`). Ignored by protocols without a page.
    #[serde(default)]
    pub serve_page: Option<bool>,
    /// TLS on a TCP listener: its certificate chain (PEM, end-entity certificate first). With
    /// [`tls_key`](Self::tls_key).
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM: PKCS #8, PKCS #1 or SEC1).
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: the CA certificates (PEM) that issue the clients' certificates; a client
    /// without one issued by them is refused in the handshake.
    #[serde(default)]
    pub tls_client_ca: Option<PathBuf>,
}

/// Where a listener listens, validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// TCP.
    Tcp(SocketAddr),
    /// A Unix stream socket.
    Unix(PathBuf),
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl ListenerConfig {
    /// A TCP listener.
    pub fn tcp(protocol: impl Into<String>, address: impl Into<String>) -> Self {
        ListenerConfig {
            protocol: protocol.into(),
            address: Some(address.into()),
            path: None,
            allowed_origins: None,
            serve_page: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
        }
    }

    /// A Unix socket listener.
    pub fn unix(protocol: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        ListenerConfig {
            protocol: protocol.into(),
            address: None,
            path: Some(path.into()),
            allowed_origins: None,
            serve_page: None,
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
        }
    }

    /// The same listener with TLS from these PEM files.
    pub fn with_tls(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls_cert = Some(cert.into());
        self.tls_key = Some(key.into());
        self
    }

    /// The same listener serving its protocol's page on a plain request, or not (see
    /// [`serve_page`](Self::serve_page)).
    ///
    /// ```
    /// use powerhub::runtime::ListenerConfig;
    ///
    /// let l = ListenerConfig::tcp("websocket", "127.0.0.1:0").with_serve_page(false);
    /// assert_eq!(l.serve_page, Some(false));
    /// ```
    pub fn with_serve_page(mut self, serve: bool) -> Self {
        self.serve_page = Some(serve);
        self
    }

    /// The validated address; `index` is the listener's position, for the error's key.
    pub fn listen_addr(&self, index: usize) -> Result<ListenAddr, ConfigError> {
        match (&self.address, &self.path) {
            (Some(a), None) => a
                .parse()
                .map(ListenAddr::Tcp)
                .map_err(|e| ConfigError::Invalid {
                    key: format!("listener[{index}].address"),
                    value: format!("{a:?}"),
                    reason: format!("not a socket address (ip:port): {e}"),
                }),
            (None, Some(p)) => {
                let bytes = p.as_os_str().as_encoded_bytes();
                let invalid = |reason: &str| ConfigError::Invalid {
                    key: format!("listener[{index}].path"),
                    value: format!("{p:?}"),
                    reason: reason.into(),
                };
                if bytes.is_empty() {
                    // Linux would bind it to a random abstract name no client can know.
                    Err(invalid("empty: give the socket file's path"))
                } else if bytes.contains(&0) {
                    Err(invalid("contains a NUL byte"))
                } else if bytes.len() > MAX_UNIX_PATH {
                    Err(invalid(&format!(
                        "longer than a Unix socket address holds ({MAX_UNIX_PATH} bytes)"
                    )))
                } else {
                    Ok(ListenAddr::Unix(p.clone()))
                }
            }
            (Some(_), Some(_)) => Err(ConfigError::Invalid {
                key: format!("listener[{index}]"),
                value: "address and path".into(),
                reason: "give either `address` (TCP) or `path` (Unix socket), not both".into(),
            }),
            (None, None) => Err(ConfigError::Invalid {
                key: format!("listener[{index}]"),
                value: "none".into(),
                reason: "give `address` (TCP) or `path` (Unix socket)".into(),
            }),
        }
    }
}

/// The whole configuration.
///
/// ```
/// use powerhub::runtime::Config;
///
/// let config = Config::from_toml("[limits]\nmax_connections = 10\n", None).unwrap();
/// assert_eq!(config.limits.max_connections, 10);
/// assert!(config.listeners.is_empty());
///
/// let err = Config::from_toml("[limits]\nmax_conections = 10\n", None).unwrap_err();
/// assert!(err.to_string().contains("max_conections"));
/// ```
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `[engine]`.
    #[serde(default)]
    pub engine: EngineSection,
    /// `[limits]`.
    #[serde(default)]
    pub limits: Limits,
    /// `[subscriptions]`.
    #[serde(default)]
    pub subscriptions: SubscriptionsSection,
    /// `[outbox]`.
    #[serde(default)]
    pub outbox: OutboxSection,
    /// `[[listener]]` tables.
    #[serde(default, rename = "listener")]
    pub listeners: Vec<ListenerConfig>,
    /// `[auth]`: authentication is on exactly when this section is present (see
    /// `docs/security.md`).
    #[serde(default)]
    pub auth: Option<AuthConfig>,
}

/// The parser's message. It quotes the line at fault, unless the error lies in `[auth]` (which
/// holds tokens and secrets) or on a line that names a token, a secret or `auth`: then it says
/// only the line, the column and the reason, with any quoted value in the reason left out
/// (`invalid type: string "…"`), since the message goes to the log.
fn parse_message(text: &str, e: &toml::de::Error) -> String {
    let Some(span) = e.span() else {
        return without_quoted_values(e.message().trim_end());
    };
    let start = span.start.min(text.len());
    let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    let quoted = text[line_start..line_end].to_ascii_lowercase();
    let names_one = ["token", "secret", "auth"]
        .iter()
        .any(|word| quoted.contains(word));
    if !names_one && !in_auth_tables(&text[..line_start]) {
        return e.to_string();
    }
    let line = text[..start].matches('\n').count() + 1;
    let column = text[line_start..start].chars().count() + 1;
    let keys = line_keys(&text[line_start..line_end]);
    let keys = if keys.is_empty() {
        String::new()
    } else {
        format!(", keys {}", keys.join(", "))
    };
    format!(
        "at line {line}, column {column}{keys} (the line is not quoted: it may hold a token or a \
         secret): {}",
        without_quoted_values(e.message().trim_end())
    )
}

/// The bare keys a line assigns (`name =`), outside its quoted strings: what can be said of a
/// line that may hold a secret.
fn line_keys(line: &str) -> Vec<&str> {
    let mut keys = Vec::new();
    let mut quote: Option<char> = None;
    let mut escaped = false;
    let mut key_start: Option<usize> = None;
    for (i, c) in line.char_indices() {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if c == '\\' && q == '"' {
                escaped = true;
            } else if c == q {
                quote = None;
            }
            continue;
        }
        match c {
            '"' | '\'' => {
                quote = Some(c);
                key_start = None;
            }
            c if c.is_ascii_alphanumeric() || c == '_' || c == '-' => {
                key_start.get_or_insert(i);
            }
            ' ' | '\t' => {}
            '=' => {
                if let Some(k) = key_start.take() {
                    keys.push(line[k..i].trim_end());
                }
            }
            _ => key_start = None,
        }
    }
    keys
}

/// Whether the last table header in `before` (the text before a line) is `[auth]` or one of
/// its tables (`[auth.jwt]`, `[[auth.tokens]]`).
fn in_auth_tables(before: &str) -> bool {
    before
        .lines()
        .rev()
        .map(str::trim_start)
        .find(|l| l.starts_with('['))
        .is_some_and(|header| {
            let name = header.trim_start_matches('[').trim_start();
            name.starts_with("auth") || name.starts_with("\"auth")
        })
}

/// `message` with the text inside each pair of double quotes left out: a value quoted in a
/// reason (`invalid type: string "s3cret", expected a sequence`) may be a secret.
fn without_quoted_values(message: &str) -> String {
    let mut out = String::with_capacity(message.len());
    let mut inside = false;
    let mut escaped = false;
    for c in message.chars() {
        if inside {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                inside = false;
                out.push_str("…\"");
            }
            continue;
        }
        out.push(c);
        if c == '"' {
            inside = true;
        }
    }
    if inside {
        out.push('…');
    }
    out
}

impl Config {
    /// The embedded default configuration (loopback listeners on the documented ports).
    pub fn embedded_default() -> Config {
        // The embedded file is a constant checked by the test `embedded_default_config_parses`.
        Config::from_toml(DEFAULT_CONFIG, Some("the embedded default config"))
            .unwrap_or_else(|e| unreachable!("the embedded default config is valid: {e}"))
    }

    /// Parses and validates a TOML text; `source_name` names it in errors.
    pub fn from_toml(text: &str, source_name: Option<&str>) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            source_name: source_name.map(str::to_owned),
            message: parse_message(text, &e),
        })?;
        // `listener = []` reads as no `[[listener]]` table, which keeps the default listeners:
        // said instead of taken for the default (the table is small: read twice).
        if config.listeners.is_empty() {
            let table: toml::Table = toml::from_str(text).map_err(|e| ConfigError::Parse {
                source_name: source_name.map(str::to_owned),
                message: parse_message(text, &e),
            })?;
            if table.contains_key("listener") {
                return Err(ConfigError::Invalid {
                    key: "listener".into(),
                    value: "[]".into(),
                    reason: "an empty list would listen nowhere; leave the key out for the \
                             default listeners, or add [[listener]] tables"
                        .into(),
                });
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a TOML file.
    pub fn from_file(path: &std::path::Path) -> Result<Config, ConfigError> {
        use std::io::Read;
        let read_error = |source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        };
        let mut text = String::new();
        // A config is a few KiB; a path naming an endless file (`/dev/zero`) is refused.
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_CONFIG_BYTES + 1).read_to_string(&mut text))
            .map_err(read_error)?;
        if text.len() as u64 > MAX_CONFIG_BYTES {
            return Err(read_error(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("a config file is at most {MAX_CONFIG_BYTES} bytes"),
            )));
        }
        Config::from_toml(&text, Some(&path.display().to_string()))
    }

    /// Checks every value's range; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        fn invalid(key: &str, value: impl std::fmt::Display, reason: &str) -> ConfigError {
            ConfigError::Invalid {
                key: key.into(),
                value: value.to_string(),
                reason: reason.into(),
            }
        }
        let l = &self.limits;
        if self.engine.turn_gap_us > MAX_TURN_GAP_US {
            return Err(invalid(
                "engine.turn_gap_us",
                self.engine.turn_gap_us,
                "at most 10000 (10 ms)",
            ));
        }
        if self.engine.hub_batch_delay_us > MAX_HUB_BATCH_DELAY_US {
            return Err(invalid(
                "engine.hub_batch_delay_us",
                self.engine.hub_batch_delay_us,
                "at most 100000 (100 ms)",
            ));
        }
        if self.engine.shards > 1024 {
            return Err(invalid(
                "engine.shards",
                self.engine.shards,
                "at most 1024 (0 = one per core)",
            ));
        }
        if l.max_connections == 0 {
            return Err(invalid("limits.max_connections", 0, "must be at least 1"));
        }
        if l.max_message_bytes < 64 || l.max_message_bytes > 1 << 30 {
            return Err(invalid(
                "limits.max_message_bytes",
                l.max_message_bytes,
                "must be between 64 and 1073741824",
            ));
        }
        if l.max_handshake_bytes < 256 || l.max_handshake_bytes > 1 << 20 {
            return Err(invalid(
                "limits.max_handshake_bytes",
                l.max_handshake_bytes,
                "must be between 256 and 1048576",
            ));
        }
        if l.max_subscriptions_per_connection == 0 || l.max_subscriptions_per_connection > 65_536 {
            return Err(invalid(
                "limits.max_subscriptions_per_connection",
                l.max_subscriptions_per_connection,
                "must be between 1 and 65536",
            ));
        }
        if l.max_json_depth < 2 || l.max_json_depth > 100_000 {
            return Err(invalid(
                "limits.max_json_depth",
                l.max_json_depth,
                "must be between 2 and 100000 (a command is an object holding a message object)",
            ));
        }
        if l.backpressure_bytes == 0 {
            return Err(invalid(
                "limits.backpressure_bytes",
                0,
                "must be at least 1",
            ));
        }
        // Under it no connection could hold its first reply and the queue around it (a ping's
        // answer takes over 200 bytes with its queue's first block): every connection would be
        // closed at its first answer.
        if l.max_outbox_bytes < MIN_OUTBOX_BYTES {
            return Err(invalid(
                "limits.max_outbox_bytes",
                l.max_outbox_bytes,
                "must be at least 65536 (one write's worth of output and its queue)",
            ));
        }
        // Only `disconnect` reads `backpressure_bytes`: there it must come before the limit
        // that closes a connection for its memory.
        if self.subscriptions.slow_consumer == SlowConsumerChoice::Disconnect
            && l.max_outbox_bytes <= l.backpressure_bytes
        {
            return Err(invalid(
                "limits.max_outbox_bytes",
                l.max_outbox_bytes,
                "must be larger than limits.backpressure_bytes under subscriptions.slow_consumer = \"disconnect\"",
            ));
        }
        for (key, value) in [
            (
                "limits.first_message_timeout_ms",
                l.first_message_timeout_ms,
            ),
            ("limits.input_hold_timeout_ms", l.input_hold_timeout_ms),
            ("limits.stall_timeout_ms", l.stall_timeout_ms),
            (
                "limits.max_unauthenticated_message_bytes",
                l.max_unauthenticated_message_bytes as u64,
            ),
        ] {
            if value == 0 {
                return Err(invalid(key, 0, "must be at least 1"));
            }
        }
        let o = &self.outbox;
        if o.high_water_bytes == 0 {
            return Err(invalid("outbox.high_water_bytes", 0, "must be at least 1"));
        }
        if o.keepalive_interval_ms == 0 {
            return Err(invalid(
                "outbox.keepalive_interval_ms",
                0,
                "must be at least 1",
            ));
        }
        if o.liveness_timeout_ms <= o.keepalive_interval_ms {
            return Err(invalid(
                "outbox.liveness_timeout_ms",
                o.liveness_timeout_ms,
                "must be longer than outbox.keepalive_interval_ms",
            ));
        }
        for (key, types) in [
            ("outbox.coalesce_types", &o.coalesce_types),
            ("outbox.drop_types", &o.drop_types),
        ] {
            if let Some(i) = types.iter().position(String::is_empty) {
                return Err(invalid(
                    &format!("{key}[{i}]"),
                    "\"\"",
                    "a message type must not be empty",
                ));
            }
        }
        let s = &self.subscriptions;
        if s.max_batch == 0 || s.max_batch > crate::hub::MAX_BATCH_LIMIT {
            return Err(invalid(
                "subscriptions.max_batch",
                s.max_batch,
                &format!("must be between 1 and {}", crate::hub::MAX_BATCH_LIMIT),
            ));
        }
        if s.max_queue == 0 || s.max_queue > crate::hub::MAX_QUEUE_LIMIT {
            return Err(invalid(
                "subscriptions.max_queue",
                s.max_queue,
                &format!("must be between 1 and {}", crate::hub::MAX_QUEUE_LIMIT),
            ));
        }
        if let Some(auth) = &self.auth {
            // Certificates alone: with no listener asking for one, nobody could authenticate.
            if auth.tokens.is_empty()
                && auth.jwt.is_none()
                && !auth.certificates.is_empty()
                && self.listeners.iter().all(|l| l.tls_client_ca.is_none())
            {
                return Err(invalid(
                    "auth.certificates",
                    format_args!("{} entries", auth.certificates.len()),
                    "are the only credentials, but no listener asks for a client certificate \
                     (tls_client_ca): nobody could authenticate; set a listener's tls_client_ca \
                     or add [[auth.tokens]] or [auth.jwt]",
                ));
            }
        }
        if self.engine.shutdown_timeout_ms > 3_600_000 {
            return Err(invalid(
                "engine.shutdown_timeout_ms",
                self.engine.shutdown_timeout_ms,
                "at most 3600000 (an hour)",
            ));
        }
        for (i, listener) in self.listeners.iter().enumerate() {
            listener.listen_addr(i)?;
            if listener.protocol.is_empty() {
                return Err(invalid(
                    &format!("listener[{i}].protocol"),
                    "\"\"",
                    "name a registered protocol",
                ));
            }
            // Read by some as "no page may connect", by others as "any may": neither is taken
            // for granted.
            if listener.allowed_origins.as_ref().is_some_and(Vec::is_empty) {
                return Err(invalid(
                    &format!("listener[{i}].allowed_origins"),
                    "[]",
                    "an empty list; list the origins to allow, [\"*\"] for any, or leave the key \
                     out for the default (the listener's own host once [auth] is on)",
                ));
            }
        }
        Ok(())
    }

    /// The parts of `fresh` that differ from this configuration and are read at start only
    /// (every section but `[auth]`, and the listeners but for their TLS file paths, which a
    /// reload names on its own): what a SIGHUP reload does not apply. Names as in the file:
    /// `[engine]`, `[limits]`, `[subscriptions]`, `[outbox]`, `[[listener]]`.
    ///
    /// ```
    /// use powerhub::runtime::Config;
    ///
    /// let running = Config::embedded_default();
    /// let mut fresh = running.clone();
    /// fresh.limits.max_connections = 1;
    /// assert_eq!(running.changed_at_start_only(&fresh), ["[limits]"]);
    /// ```
    pub fn changed_at_start_only(&self, fresh: &Config) -> Vec<&'static str> {
        let mut changed = Vec::new();
        if self.engine != fresh.engine {
            changed.push("[engine]");
        }
        if self.limits != fresh.limits {
            changed.push("[limits]");
        }
        if self.subscriptions != fresh.subscriptions {
            changed.push("[subscriptions]");
        }
        if self.outbox != fresh.outbox {
            changed.push("[outbox]");
        }
        let tls_paths_aside = |l: &ListenerConfig| ListenerConfig {
            tls_cert: None,
            tls_key: None,
            tls_client_ca: None,
            ..l.clone()
        };
        if self.listeners.len() != fresh.listeners.len()
            || self
                .listeners
                .iter()
                .zip(&fresh.listeners)
                .any(|(a, b)| tls_paths_aside(a) != tls_paths_aside(b))
        {
            changed.push("[[listener]]");
        }
        changed
    }

    /// The shard count after resolving 0 to the number of cores.
    pub fn shard_count(&self) -> usize {
        if self.engine.shards > 0 {
            self.engine.shards
        } else {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a configuration is refused with, as it is printed.
    fn refusal(toml: &str) -> String {
        Config::from_toml(toml, None).unwrap_err().to_string()
    }

    /// An explicit empty list is refused with the key named, not read as the default.
    #[test]
    fn an_empty_listener_list_or_origin_list_is_refused_naming_its_key() {
        let err = refusal("listener = []\n");
        assert!(err.contains("listener") && err.contains("empty"), "{err}");
        let err = refusal("[[listener]]\nprotocol = \"websocket\"\naddress = \"127.0.0.1:0\"\nallowed_origins = []\n");
        assert!(err.contains("listener[0].allowed_origins"), "{err}");
        assert!(Config::from_toml("[limits]\nmax_connections = 10\n", None).is_ok());
    }

    #[test]
    fn embedded_default_config_parses() {
        let c = Config::from_toml(DEFAULT_CONFIG, None).unwrap();
        assert_eq!(c.limits, Limits::default());
        assert_eq!(c.subscriptions, SubscriptionsSection::default());
        assert_eq!(c.outbox, OutboxSection::default());
        assert_eq!(
            c.listeners[0],
            ListenerConfig::tcp("ndjson", "127.0.0.1:7400")
        );
        assert_eq!(
            c.listeners[1],
            ListenerConfig::tcp("frame", "127.0.0.1:7401")
        );
    }

    #[test]
    fn unknown_key_is_an_error_naming_key_and_line() {
        let msg = refusal("[engine]\nshards = 2\n\n[limits]\nmax_conections = 1\n");
        assert!(msg.contains("max_conections"), "{msg}");
        assert!(msg.contains("line 5"), "{msg}");
    }

    /// A token's permissions, rates and limits are tables: an array (read field by field in
    /// order, where `[{allow = [">"]}]` would be a publish rule) is refused, naming the key.
    #[test]
    fn a_token_permission_limit_or_rate_given_as_an_array_is_refused() {
        for (value, key) in [
            (r#"permissions = [{ allow = [">"] }]"#, "permissions"),
            (r#"permissions = { subscribe = [[">"]] }"#, "subscribe"),
            ("limits = [1]", "limits"),
            ("rates = [1]", "rates"),
        ] {
            let text = format!("[auth]\n[[auth.tokens]]\ntoken = \"t\"\nuser = \"u\"\n{value}\n");
            let err = refusal(&text);
            assert!(err.contains("a table of named fields"), "{value}: {err}");
            assert!(err.contains(key), "{value}: {err}");
        }
    }

    /// `[[auth.certificates]]` as the only credentials, with no listener asking for a client
    /// certificate, would let nobody in: refused, naming the key and what is missing.
    #[test]
    fn certificates_alone_with_no_listener_asking_for_one_are_refused() {
        let certs = "[auth]\n[[auth.certificates]]\nsubject = \"CN=meter\"\nuser = \"meter\"\n";
        let plain = "[[listener]]\nprotocol = \"ndjson\"\naddress = \"127.0.0.1:0\"\n";
        let err = refusal(&format!("{certs}{plain}"));
        assert!(
            err.contains("auth.certificates") && err.contains("tls_client_ca"),
            "{err}"
        );
        let asking = format!(
            "{plain}tls_cert = \"s.pem\"\ntls_key = \"s.key\"\ntls_client_ca = \"ca.pem\"\n"
        );
        assert!(Config::from_toml(&format!("{certs}{asking}"), None).is_ok());
        let token = "[[auth.tokens]]\ntoken = \"t\"\nuser = \"u\"\n";
        assert!(Config::from_toml(&format!("{certs}{token}{plain}"), None).is_ok());
    }

    /// What a SIGHUP reload does not apply is named: every section but `[auth]`, and the
    /// listeners but for their TLS paths (named by the reload on their own).
    #[test]
    fn a_reload_names_every_section_read_at_start_only_that_changed() {
        let running = Config::embedded_default();
        assert!(running.changed_at_start_only(&running.clone()).is_empty());
        let mut fresh = running.clone();
        fresh.auth = Some(Default::default());
        fresh.listeners[0].tls_cert = Some("new.pem".into());
        assert!(
            running.changed_at_start_only(&fresh).is_empty(),
            "auth and TLS paths"
        );
        fresh.engine.shards = 7;
        fresh.outbox.high_water_bytes = 1;
        fresh.subscriptions.max_batch = 1;
        fresh.limits.max_connections = 1;
        fresh.listeners[1].address = Some("127.0.0.1:1".into());
        assert_eq!(
            running.changed_at_start_only(&fresh),
            [
                "[engine]",
                "[limits]",
                "[subscriptions]",
                "[outbox]",
                "[[listener]]"
            ]
        );
        fresh.listeners = running.listeners.clone();
        fresh.listeners.pop();
        assert!(running
            .changed_at_start_only(&fresh)
            .contains(&"[[listener]]"));
    }

    #[test]
    fn a_max_outbox_bytes_no_connection_could_live_under_is_refused() {
        for v in [0, 100, 65_535] {
            let err = refusal(&format!("[limits]\nmax_outbox_bytes = {v}\n"));
            assert!(
                err.contains("limits.max_outbox_bytes") && err.contains("65536"),
                "{err}"
            );
        }
        assert!(Config::from_toml("[limits]\nmax_outbox_bytes = 65536\n", None).is_ok());
    }

    /// A parse error names its line and column and the parser's reason, never the text of the
    /// line, which may hold a secret.
    #[test]
    fn a_parse_error_names_the_line_but_never_repeats_a_secret() {
        for text in [
            "[auth]\n[[auth.tokens]]\ntoken = \"s3cret\n",
            "[auth]\ntokens = [{ token = \"s3cret\", usr = \"x\" }]\n",
            "[auth.jwt]\nalgorithm = \"HS256\"\nsecret = \"s3cret\" x\n",
            // A misspelt key, a key in capitals, values of the wrong type, a multi-line one.
            "[auth]\n[[auth.tokens]]\ntokn = \"s3cret\"\nuser = \"u\"\n",
            "[auth]\n[[auth.tokens]]\nToken = \"s3cret\"\nuser = \"u\"\n",
            "[auth.jwt]\nsecert = \"s3cret\"\n",
            "[auth]\ntokens = \"s3cret\"\n",
            "[auth]\njwt = \"s3cret\"\n",
            "[auth]\n[[auth.tokens]]\ntoken = '''\ns3cret''' x\n",
            "auth = { tokens = \"s3cret\" }\n",
        ] {
            let err = refusal(text);
            assert!(!err.contains("s3cret"), "{err}");
            assert!(err.contains("at line "), "{err}");
        }
        // Other lines are quoted, as the parser quotes them.
        let err = refusal("[limits]\nmax_connectionz = 10\n");
        assert!(
            err.contains("line 2") && err.contains("max_connectionz = 10"),
            "{err}"
        );
    }

    #[test]
    fn invalid_value_names_the_key() {
        let err = refusal("[limits]\nmax_connections = 0\n");
        assert!(err.contains("limits.max_connections"), "{err}");
        let err = refusal("[[listener]]\nprotocol = \"ndjson\"\naddress = \"nope\"\n");
        assert!(err.contains("listener[0].address"), "{err}");
        let err = refusal("[engine]\nbackend = \"kqueue\"\n");
        assert!(err.contains("kqueue"), "{err}");
    }

    #[test]
    fn a_unix_path_no_client_could_connect_to_is_refused_naming_the_key() {
        let long = "a".repeat(MAX_UNIX_PATH + 1);
        for (path, why) in [
            ("", "empty"),
            ("/tmp/a\\u0000b", "NUL"),
            (long.as_str(), "longer than"),
        ] {
            let err = refusal(&format!(
                "[[listener]]\nprotocol = \"ndjson\"\npath = \"{path}\"\n"
            ));
            assert!(
                err.contains("listener[0].path") && err.contains(why),
                "{path:?}: {err}"
            );
        }
        let fits = "a".repeat(MAX_UNIX_PATH);
        assert!(Config::from_toml(
            &format!("[[listener]]\nprotocol = \"ndjson\"\npath = \"{fits}\"\n"),
            None
        )
        .is_ok());
    }

    #[test]
    fn max_outbox_bytes_must_pass_backpressure_bytes_only_where_disconnect_reads_it() {
        let small = "[limits]\nmax_outbox_bytes = 4194304\n";
        let c = Config::from_toml(small, None).unwrap();
        assert_eq!(c.limits.max_outbox_bytes, 4 << 20);
        let msg = refusal(&format!(
            "{small}\n[subscriptions]\nslow_consumer = \"disconnect\"\n"
        ));
        assert!(
            msg.contains("limits.max_outbox_bytes") && msg.contains("disconnect"),
            "{msg}"
        );
    }

    #[test]
    fn the_first_message_deadline_is_read_under_its_former_name_too() {
        let c = Config::from_toml(DEFAULT_CONFIG, None).unwrap();
        assert_eq!(
            c.limits.first_message_timeout(),
            Duration::from_millis(DEFAULT_FIRST_MESSAGE_TIMEOUT_MS)
        );
        let c = Config::from_toml("[limits]\nfirst_message_timeout_ms = 200\n", None).unwrap();
        assert_eq!(c.limits.first_message_timeout_ms, 200);
        let c = Config::from_toml("[limits]\nhandshake_timeout_ms = 300\n", None).unwrap();
        assert_eq!(c.limits.first_message_timeout_ms, 300);
        let err = refusal("[limits]\nfirst_message_timeout_ms = 0\n");
        assert!(err.contains("limits.first_message_timeout_ms"), "{err}");
    }

    #[test]
    fn the_waits_for_held_input_and_a_stall_are_read_and_zero_is_refused_naming_the_key() {
        let c = Config::from_toml(DEFAULT_CONFIG, None).unwrap();
        assert_eq!(
            Duration::from_millis(c.limits.input_hold_timeout_ms),
            crate::push::INPUT_WAIT
        );
        assert_eq!(
            Duration::from_millis(c.limits.stall_timeout_ms),
            crate::push::STALL_WAIT
        );
        let c = Config::from_toml(
            "[limits]\ninput_hold_timeout_ms = 30000\nstall_timeout_ms = 2000\n",
            None,
        )
        .unwrap();
        let limits = crate::push::PushLimits::from_config(&c);
        assert_eq!(
            (limits.input_hold_timeout_ms, limits.stall_timeout_ms),
            (30_000, 2_000)
        );
        for key in ["input_hold_timeout_ms", "stall_timeout_ms"] {
            let err = refusal(&format!("[limits]\n{key} = 0\n"));
            assert!(err.contains(&format!("limits.{key}")), "{err}");
        }
    }

    #[test]
    fn turn_gap_over_its_maximum_is_an_error_naming_the_key() {
        let c = Config::from_toml(DEFAULT_CONFIG, None).unwrap();
        assert_eq!(
            c.engine.turn_gap_us, DEFAULT_TURN_GAP_US,
            "the embedded default"
        );
        let ok = Config::from_toml("[engine]\nturn_gap_us = 10000\n", None).unwrap();
        assert_eq!(ok.engine.turn_gap(), Duration::from_millis(10));
        let off = Config::from_toml("[engine]\nturn_gap_us = 0\n", None).unwrap();
        assert!(off.engine.turn_gap().is_zero());
        let msg = refusal("[engine]\nturn_gap_us = 10001\n");
        assert!(
            msg.contains("engine.turn_gap_us") && msg.contains("10001"),
            "{msg}"
        );
    }

    #[test]
    fn hub_batch_delay_over_its_maximum_is_an_error_naming_the_key() {
        let c = Config::from_toml(DEFAULT_CONFIG, None).unwrap();
        assert_eq!(
            c.engine.hub_batch_delay_us,
            EngineSection::default().hub_batch_delay_us
        );
        let ok = Config::from_toml("[engine]\nhub_batch_delay_us = 100000\n", None).unwrap();
        assert_eq!(ok.engine.hub_batch_delay(), Duration::from_millis(100));
        let err = refusal("[engine]\nhub_batch_delay_us = 100001\n");
        assert!(err.contains("engine.hub_batch_delay_us"), "{err}");
    }

    #[test]
    fn a_value_out_of_its_range_is_an_error_naming_the_key() {
        for (text, key) in [
            (
                "[outbox]\ncoalesce_types = [\"a\", \"\"]\n",
                "outbox.coalesce_types[1]",
            ),
            ("[outbox]\ndrop_types = [\"\"]\n", "outbox.drop_types[0]"),
            (
                "[subscriptions]\nmax_queue = 0\n",
                "subscriptions.max_queue",
            ),
            (
                "[subscriptions]\nmax_queue = 1048577\n",
                "subscriptions.max_queue",
            ),
            (
                "[subscriptions]\nmax_batch = 65537\n",
                "subscriptions.max_batch",
            ),
            (
                "[limits]\nmax_subscriptions_per_connection = 65537\n",
                "limits.max_subscriptions_per_connection",
            ),
            (
                "[engine]\nshutdown_timeout_ms = 3600001\n",
                "engine.shutdown_timeout_ms",
            ),
            ("[limits]\nmax_json_depth = 1\n", "limits.max_json_depth"),
            (
                "[limits]\nmax_json_depth = 100001\n",
                "limits.max_json_depth",
            ),
        ] {
            let err = refusal(text);
            assert!(err.contains(key), "{text}: {err}");
        }
        let c = Config::from_toml("[limits]\nmax_json_depth = 2\n", None).unwrap();
        assert_eq!(c.limits.max_json_depth, 2);
    }
}
