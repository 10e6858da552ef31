//! The runtime: sharded worker threads, IO backends (io_uring, epoll), listeners, the server.
//!
//! [`Engine`] binds the configured listeners, starts N shards (worker threads, one per core by
//! default), each owning its connections, timers and IO backend, and serves the push protocol over
//! every registered stream-protocol plugin. A service can run it in-process and publish into its
//! hub from any of its own threads; `powerhub serve` is this engine plus a CLI.
//!
//! - Backends: io_uring when the kernel allows it (probed once per process for every opcode
//!   used), epoll otherwise; `backend = "epoll"` in the config or `POWERHUB_BACKEND=epoll` in the
//!   environment forces epoll. The contract both implement is written in `sys/mod.rs`.
//! - Shards: reached from other threads through a lock-free queue and an eventfd wake-up; the
//!   write path takes no lock. Every shard accepts on every listener (the kernel wakes one
//!   per connection); the accepting shard assigns the connection round-robin over all shards,
//!   for life (handing it over when it is another's), so no shard is special.
//! - Fan-out runs on the shards: each holds the push subscriptions of its own connections and
//!   hands each topic batch, encoded once per wire format, to their outboxes (`fanout.rs`). A
//!   publish from any thread only queues the entry for each interested shard.
//! - The engine's own hub, for library subscribers of [`Engine::hub`], drains on a thread of
//!   its own ([`Driver::Thread`], woken by a publish that queued for one of them): no shard
//!   runs hub turns, so every shard does the same work. With no library subscriber that thread
//!   never wakes: push subscriptions do not go through it.
//! - Plugins: listeners name a [`ProtocolFactory`] registered in
//!   a [`ProtocolRegistry`].
//!
//! # Examples
//!
//! ```
//! use powerhub::runtime::{Config, Engine, ListenerConfig, ProtocolRegistry};
//!
//! let mut config = Config::default();
//! config.listeners.push(ListenerConfig::tcp("ndjson", "127.0.0.1:0"));
//! let engine = Engine::start(config, &ProtocolRegistry::with_builtins())?;
//! println!("listening on {} with {}", engine.listeners()[0].addr, engine.backend());
//! engine.shutdown()?;
//! # Ok::<(), powerhub::runtime::EngineError>(())
//! ```

use std::fmt;
use std::io;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crossbeam_utils::CachePadded;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use powerhub_plugin::{
    CloseReason, Completion, Frame, ListenerOptions, OriginPolicy, ProtocolFactory, ProtocolLimits,
    SendError, SendOutcome, Sink, SubscriberRef,
};

use crate::hub::{DeliveryError, Driver, Hub, HubOptions, OptionsError};
use crate::outbox::{Framing, MessageFactory, OutboxConfig, PayloadFactory};
use crate::protocol::{AuthPolicy, SessionConfig};
use crate::push::{PushConfig, PushConfigError, PushLimits, PushLimitsError};
use crate::security::auth::{AuthConfig, AuthConfigError, Authenticator};
use crate::security::tls::{server_config, TlsError, TlsFiles};

mod alloc;
mod config;
mod fanout;
mod parker;
mod registry;
mod shard;
mod sys;
mod tls;

pub use config::{
    BackendChoice, Config, ConfigError, EngineSection, Limits, ListenAddr, ListenerConfig,
    OutboxSection, SlowConsumerChoice, SubscriptionsSection, BACKEND_ENV, DEFAULT_CONFIG,
    DEFAULT_FIRST_MESSAGE_TIMEOUT_MS, DEFAULT_TURN_GAP_US, MAX_HUB_BATCH_DELAY_US, MAX_TURN_GAP_US,
    SMALL_SEND_BYTES,
};
pub use registry::{ProtocolRegistry, RegistryError};

use shard::{Counters, Shard, ShardHandle, ShardMsg};

/// The IO backend the shards run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendKind {
    /// io_uring.
    IoUring,
    /// epoll.
    Epoll,
    /// Some shards io_uring, the others epoll: io_uring was asked for, and some shards could
    /// not set it up (a memory-lock limit, say; the log names each such shard).
    Mixed,
}

impl BackendKind {
    /// `io_uring`, `epoll`, or `io_uring+epoll` for [`BackendKind::Mixed`].
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::IoUring => "io_uring",
            BackendKind::Epoll => "epoll",
            BackendKind::Mixed => "io_uring+epoll",
        }
    }
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why the engine could not start or stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The configuration was invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A listener names a protocol that is not registered.
    #[error("listener[{index}].protocol: {source}")]
    Protocol {
        /// The listener's position in the config.
        index: usize,
        /// What was wrong.
        source: RegistryError,
    },
    /// A listener's address could not be bound (in use, not permitted, not local).
    #[error("cannot listen on {addr} (listener[{index}], protocol {protocol}): {source}")]
    Bind {
        /// The listener's position in the config.
        index: usize,
        /// The protocol.
        protocol: String,
        /// The address.
        addr: ListenAddr,
        /// The OS error.
        source: io::Error,
    },
    /// `POWERHUB_BACKEND` holds an unknown value.
    #[error("environment variable {BACKEND_ENV}: {0}")]
    BackendEnv(String),
    /// The hub could not be created.
    #[error("cannot create the hub: {0}")]
    Hub(#[from] OptionsError),
    /// The `[outbox]` settings were refused.
    #[error("invalid configuration value in [outbox]: {0}")]
    Outbox(String),
    /// The `[auth]` section cannot be used (no credentials, a bad pattern, an unreadable or
    /// unusable key).
    #[error("invalid [auth] section: {0}")]
    Auth(#[from] AuthConfigError),
    /// A listener's TLS files cannot be used (missing, unreadable, not PEM, a key that is not
    /// the certificate's); the error names the key and the file.
    #[error("listener[{index}]: {source}")]
    Tls {
        /// The listener's position in the config.
        index: usize,
        /// What was wrong.
        source: TlsError,
    },
    /// A listener's settings cannot apply to its protocol (an invalid `allowed_origins` entry).
    #[error("listener[{index}]: {message}")]
    Listener {
        /// The listener's position in the config.
        index: usize,
        /// What was wrong, naming the setting.
        message: String,
    },
    /// A shard could not be started.
    #[error("cannot start shard {index}: {source}")]
    Shard {
        /// The shard.
        index: usize,
        /// The OS error.
        source: io::Error,
    },
}

/// A listener's TLS files and the configuration built from them (read now), if it has TLS.
fn listener_tls(
    l: &ListenerConfig,
) -> Result<Option<(TlsFiles, Arc<rustls::ServerConfig>)>, TlsError> {
    let Some(files) = TlsFiles::from_listener_keys(
        l.tls_cert.as_deref(),
        l.tls_key.as_deref(),
        l.tls_client_ca.as_deref(),
    )?
    else {
        return Ok(None);
    };
    let config = server_config(&files)?;
    Ok(Some((files, config)))
}

/// The authentication policy of an `[auth]` section (key files read now).
fn auth_policy(config: &AuthConfig) -> Result<AuthPolicy, AuthConfigError> {
    let mut policy = AuthPolicy::new(Arc::new(Authenticator::from_config(config)?));
    policy.allow_reply_types = config.allow_reply_types;
    policy.max_connections_per_user = config.max_connections_per_user;
    policy.max_subscriptions_per_user = config.max_subscriptions_per_user;
    policy.publish_messages_per_second_per_user = config.publish_messages_per_second_per_user;
    policy.publish_bytes_per_second_per_user = config.publish_bytes_per_second_per_user;
    Ok(policy)
}

/// A bound listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundListener {
    /// The protocol served.
    pub protocol: String,
    /// The bound address (with the actual port when port 0 was asked for).
    pub addr: ListenAddr,
}

/// A snapshot of the engine's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineStats {
    /// Connections open now (not counting ones refused over `max_connections`).
    pub open_connections: usize,
    /// Connections accepted since start (including refused ones).
    pub accepted: u64,
    /// Connections closed since start (their memory released).
    pub closed: u64,
    /// Connections refused over `max_connections`.
    pub rejected: u64,
    /// Times a client went over a limit (each got an error naming it).
    pub limit_errors: u64,
    /// Protocol errors (framing violations, oversized messages).
    pub protocol_errors: u64,
    /// Push subscriptions held by connections now.
    pub subscriptions: usize,
    /// Bytes received.
    pub bytes_in: u64,
    /// Bytes the kernel took.
    pub bytes_out: u64,
    /// Hub frames queued onto connections.
    pub frames_out: u64,
    /// Sends started (`sendmsg` calls or io_uring `SENDMSG` submissions).
    pub sends: u64,
    /// Unsent bytes across connections, as last published by the shards.
    pub unsent_bytes: usize,
    /// Each shard's share, by shard index (the fields above that are kept per shard are their
    /// sums): how the connections and the fan-out spread over the shards.
    pub shards: Vec<ShardStats>,
}

/// One shard's share of the [`EngineStats`] counters.
///
/// ```
/// use powerhub::runtime::{Config, Engine, ListenerConfig, ProtocolRegistry};
///
/// let mut config = Config::default();
/// config.engine.shards = 2;
/// config.listeners.push(ListenerConfig::tcp("ndjson", "127.0.0.1:0"));
/// let engine = Engine::start(config, &ProtocolRegistry::with_builtins())?;
/// let stats = engine.stats();
/// assert_eq!(stats.shards.len(), 2);
/// assert_eq!(stats.shards.iter().map(|s| s.subscriptions).sum::<usize>(), stats.subscriptions);
/// engine.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardStats {
    /// Push subscriptions held by the shard's connections now.
    pub subscriptions: usize,
    /// Connections the shard closed. (An accepted connection is counted by the shard that
    /// accepted it, which may hand it to another: see [`EngineStats::accepted`].)
    pub closed: u64,
    /// Bytes received on the shard's connections.
    pub bytes_in: u64,
    /// Bytes the kernel took from the shard's connections.
    pub bytes_out: u64,
    /// Hub frames queued onto the shard's connections.
    pub frames_out: u64,
    /// Sends the shard started.
    pub sends: u64,
    /// Unsent bytes across the shard's connections, as it last published them.
    pub unsent_bytes: usize,
}

/// Slack past a shutdown deadline for the shards' coarse timers to act on it.
const TICK_GRACE: Duration = Duration::from_millis(200);

/// The longest a shutdown waits for every shard to stop reading, however short its budget: a
/// shard stops at its next turn (well under this), and no shard may close its connections while
/// another still reads.
const STOP_READING_WAIT: Duration = Duration::from_secs(1);

/// How often a shutdown checks whether the shards have read everything.
const QUIET_POLL: Duration = Duration::from_millis(2);

/// The stream the engine publishes its counters to: `{"type":"stats","stream":"$stats",
/// "stats":{...}}`, every `engine.stats_interval_ms` while it has subscribers.
pub const STATS_STREAM: &str = "$stats";

/// Most subscribers listed in one stats message (the first in drain order; `subscribers` counts
/// them all), so that the message stays small however many subscribe.
pub const STATS_LIST_MAX: usize = 100;

/// The stats message: the hub's counters (and its first subscribers) and the engine's, each
/// object's members in the order docs/websocket.md shows them.
fn stats_json(shared: &Shared, backend: BackendKind) -> String {
    use serde::Serialize;

    #[derive(Serialize)]
    struct StatsMessage<'a> {
        r#type: &'static str,
        stream: &'static str,
        stats: HubPart<'a>,
    }
    #[derive(Serialize)]
    struct HubPart<'a> {
        subscribers: usize,
        topics: usize,
        published: u64,
        delivered: u64,
        dropped: u64,
        disconnected: u64,
        encoded: u64,
        bytes_out: u64,
        list: Vec<Row<'a>>,
        engine: EnginePart,
    }
    #[derive(Serialize)]
    struct Row<'a> {
        id: &'a str,
        topic: &'a str,
        queued: usize,
        dropped: u64,
        bytes_sent: u64,
        in_flight: bool,
    }
    #[derive(Serialize)]
    struct EnginePart {
        backend: &'static str,
        open_connections: usize,
        accepted: u64,
        closed: u64,
        rejected: u64,
        limit_errors: u64,
        subscriptions: usize,
        bytes_in: u64,
        bytes_out: u64,
        sends: u64,
        unsent_bytes: usize,
        shards: Vec<ShardPart>,
    }
    #[derive(Serialize)]
    struct ShardPart {
        subscriptions: usize,
        bytes_out: u64,
        frames_out: u64,
        sends: u64,
        unsent_bytes: usize,
    }

    let h = shared.hub.stats();
    let e = shared.engine_stats();
    let message = StatsMessage {
        r#type: "stats",
        stream: STATS_STREAM,
        stats: HubPart {
            subscribers: h.subscribers,
            topics: h.topics,
            published: h.published,
            delivered: h.delivered,
            dropped: h.dropped,
            disconnected: h.disconnected,
            encoded: h.encoded,
            bytes_out: h.bytes_out,
            list: h
                .list
                .iter()
                .take(STATS_LIST_MAX)
                .map(|s| Row {
                    id: &s.id,
                    topic: &s.topic,
                    queued: s.queued,
                    dropped: s.dropped,
                    bytes_sent: s.bytes_sent,
                    in_flight: s.in_flight,
                })
                .collect(),
            engine: EnginePart {
                backend: backend.as_str(),
                open_connections: e.open_connections,
                accepted: e.accepted,
                closed: e.closed,
                rejected: e.rejected,
                limit_errors: e.limit_errors,
                subscriptions: e.subscriptions,
                bytes_in: e.bytes_in,
                bytes_out: e.bytes_out,
                sends: e.sends,
                unsent_bytes: e.unsent_bytes,
                shards: e
                    .shards
                    .iter()
                    .map(|s| ShardPart {
                        subscriptions: s.subscriptions,
                        bytes_out: s.bytes_out,
                        frames_out: s.frames_out,
                        sends: s.sends,
                        unsent_bytes: s.unsent_bytes,
                    })
                    .collect(),
            },
        },
    };
    serde_json::to_string(&message).expect("plain counters serialize")
}

/// What every shard shares (read-only after start, plus atomic counters).
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) listeners: Vec<ListenerSpec>,
    shards: OnceLock<Vec<Arc<ShardHandle>>>,
    /// Each shard's counters (see [`Counters`]), by shard index.
    counters: Box<[CachePadded<Counters>]>,
    /// Open connections (what `limits.max_connections` bounds): added by the accepting shard,
    /// subtracted by the owning one. `Relaxed`: a count.
    pub(crate) open: AtomicUsize,
    pub(crate) hub: Hub,
    /// What every push connection shares: its limits, outbox settings and notifications.
    pub(crate) push_config: Arc<PushConfig>,
    pub(crate) next_conn_id: AtomicU64,
    /// The round-robin assignment of accepted connections to shards, shared by the shards
    /// that accept. `Relaxed`: only spreads the load; no other memory depends on it.
    pub(crate) next_owner: AtomicUsize,
    /// How connections authenticate: `None` while the config has no `[auth]` section. Read
    /// once per accepted connection; replaced by [`Engine::reload_auth`] (open connections
    /// keep the policy they started with, and their identities).
    pub(crate) auth: RwLock<Option<AuthPolicy>>,
    /// Every push session's limits (from `[limits]`).
    pub(crate) session_config: Arc<SessionConfig>,
}

impl fmt::Debug for Shared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Shared")
            .field("listeners", &self.listeners.len())
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Shard `index`'s counters (written by that shard only).
    pub(crate) fn counters_of(&self, index: usize) -> &Counters {
        &self.counters[index]
    }

    /// A snapshot of the counters, summed over the shards.
    fn engine_stats(&self) -> EngineStats {
        let sum = |f: &dyn Fn(&Counters) -> u64| self.counters.iter().map(|c| f(c)).sum::<u64>();
        let sum_usize = |f: &dyn Fn(&Counters) -> usize| {
            // Each shard's share is its own adds less its own subtractions.
            self.counters.iter().map(|c| f(c)).sum::<usize>()
        };
        EngineStats {
            open_connections: self.open.load(Ordering::Relaxed),
            accepted: sum(&|c| c.accepted.load(Ordering::Relaxed)),
            closed: sum(&|c| c.closed.load(Ordering::Relaxed)),
            rejected: sum(&|c| c.rejected.load(Ordering::Relaxed)),
            limit_errors: sum(&|c| c.limit_errors.load(Ordering::Relaxed)),
            protocol_errors: sum(&|c| c.protocol_errors.load(Ordering::Relaxed)),
            subscriptions: sum_usize(&|c| c.subscriptions.load(Ordering::Relaxed)),
            bytes_in: sum(&|c| c.bytes_in.load(Ordering::Relaxed)),
            bytes_out: sum(&|c| c.bytes_out.load(Ordering::Relaxed)),
            frames_out: sum(&|c| c.frames_out.load(Ordering::Relaxed)),
            sends: sum(&|c| c.send_syscalls.load(Ordering::Relaxed)),
            unsent_bytes: sum_usize(&|c| c.unsent.load(Ordering::Relaxed)),
            shards: self
                .counters
                .iter()
                .map(|c| ShardStats {
                    subscriptions: c.subscriptions.load(Ordering::Relaxed),
                    closed: c.closed.load(Ordering::Relaxed),
                    bytes_in: c.bytes_in.load(Ordering::Relaxed),
                    bytes_out: c.bytes_out.load(Ordering::Relaxed),
                    frames_out: c.frames_out.load(Ordering::Relaxed),
                    sends: c.send_syscalls.load(Ordering::Relaxed),
                    unsent_bytes: c.unsent.load(Ordering::Relaxed),
                })
                .collect(),
        }
    }

    pub(crate) fn shards(&self) -> &[Arc<ShardHandle>] {
        self.shards.get().map_or(&[], Vec::as_slice)
    }
}

/// A listener as the shards see it.
#[derive(Debug)]
pub(crate) struct ListenerSpec {
    pub(crate) factory: Arc<dyn ProtocolFactory>,
    pub(crate) protocol_limits: ProtocolLimits,
    pub(crate) addr: ListenAddr,
    /// TLS: the files (for a reload) and the configuration new connections start with.
    pub(crate) tls: Option<(TlsFiles, RwLock<Arc<rustls::ServerConfig>>)>,
}

/// The running engine: shards, listeners and the hub they serve.
///
/// Dropping it stops the shards at once (connections are closed without waiting for their
/// queues); [`shutdown`](Engine::shutdown) is the graceful stop.
pub struct Engine {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    backend: BackendKind,
    bound: Vec<BoundListener>,
    unix_paths: Vec<PathBuf>,
    owns_hub: bool,
    /// Dropping it stops the stats publisher.
    stats_stop: Option<std::sync::mpsc::Sender<()>>,
    stats_thread: Option<JoinHandle<()>>,
    stopped: bool,
}

impl fmt::Debug for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.backend)
            .field("listeners", &self.bound)
            .finish_non_exhaustive()
    }
}

/// Chooses the backend: the environment override, then the config, then the io_uring probe.
fn choose_backend(choice: BackendChoice) -> Result<BackendKind, EngineError> {
    let env = match std::env::var(BACKEND_ENV) {
        Ok(v) if !v.is_empty() => Some(
            v.parse::<BackendChoice>()
                .map_err(EngineError::BackendEnv)?,
        ),
        _ => None,
    };
    let choice = match env {
        Some(BackendChoice::Epoll) => {
            tracing::info!("{BACKEND_ENV}=epoll forces the epoll backend");
            BackendChoice::Epoll
        }
        _ => choice,
    };
    if choice == BackendChoice::Epoll {
        return Ok(BackendKind::Epoll);
    }
    match sys::uring::probe() {
        Ok(()) => Ok(BackendKind::IoUring),
        Err(why) => {
            tracing::warn!(reason = %why, "io_uring is unavailable; falling back to epoll");
            Ok(BackendKind::Epoll)
        }
    }
}

fn bind(
    index: usize,
    protocol: &str,
    addr: &ListenAddr,
) -> Result<(OwnedFd, ListenAddr), EngineError> {
    let err = |source: io::Error| EngineError::Bind {
        index,
        protocol: protocol.to_owned(),
        addr: addr.clone(),
        source,
    };
    match addr {
        ListenAddr::Tcp(a) => {
            let l = std::net::TcpListener::bind(a).map_err(err)?;
            l.set_nonblocking(true).map_err(err)?;
            deepen_backlog(&l).map_err(err)?;
            let local = ListenAddr::Tcp(l.local_addr().map_err(err)?);
            Ok((OwnedFd::from(l), local))
        }
        ListenAddr::Unix(path) => {
            use std::os::unix::fs::FileTypeExt;
            if let Ok(meta) = std::fs::symlink_metadata(path) {
                if !meta.file_type().is_socket() {
                    return Err(err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "the path exists and is not a socket",
                    )));
                }
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(err(io::Error::new(
                        io::ErrorKind::AddrInUse,
                        "another server listens on this socket",
                    )));
                }
                // A stale socket file left by a process that is gone.
                std::fs::remove_file(path).map_err(err)?;
            }
            let l = std::os::unix::net::UnixListener::bind(path).map_err(err)?;
            l.set_nonblocking(true).map_err(err)?;
            deepen_backlog(&l).map_err(err)?;
            Ok((OwnedFd::from(l), addr.clone()))
        }
    }
}

/// Connections the kernel queues on a listener before a shard accepts them (capped by the
/// kernel's `net.core.somaxconn`). The standard library listens with 128, which a burst of
/// connections overflows while every shard is busy: the clients past it wait a second for a
/// SYN retransmit.
const LISTEN_BACKLOG: libc::c_int = 4096;

/// Listens on `listener` again with [`LISTEN_BACKLOG`] (a second `listen` only resizes the queue).
fn deepen_backlog(listener: &impl std::os::fd::AsRawFd) -> io::Result<()> {
    // SAFETY: the descriptor is a bound socket the caller owns for the call.
    sys::syscall!(listen(listener.as_raw_fd(), LISTEN_BACKLOG)).map(drop)
}

/// The sink of the engine's own hub: push subscriptions are not hub subscribers, so this one
/// only answers library subscriptions made without a sink of their own.
#[derive(Debug)]
struct NoSink;

impl Sink for NoSink {
    fn send(&self, _sub: &SubscriberRef, _frame: Frame, _done: Completion) -> SendOutcome {
        SendOutcome::Failed(SendError::Refused(
            "subscribe with a sink: the engine's hub has no default transport".into(),
        ))
    }

    fn close(&self, _sub: &SubscriberRef, _reason: CloseReason) {}
}

/// The engine's own hub reports its errors here. A send that failed as [`SendError::Closed`]
/// is its subscriber's close, not logged again.
fn report_hub_error(err: &DeliveryError, sub: Option<&SubscriberRef>) {
    match err {
        DeliveryError::SendFailed {
            error: SendError::Closed,
            ..
        } => {}
        _ => tracing::warn!(subscriber = sub.map(|s| s.id()), "powerhub: {err}"),
    }
}

/// Options of [`Engine::builder`]: the hub to serve and the push-message factory.
///
/// ```
/// use powerhub::hub::{Hub, HubOptions};
/// use powerhub::runtime::{Config, Engine, ListenerConfig};
/// # #[derive(Debug)] struct MySink;
/// # impl powerhub::plugin::Sink for MySink {
/// #     fn send(&self, _: &powerhub::plugin::SubscriberRef, _: powerhub::plugin::Frame, _: powerhub::plugin::Completion) -> powerhub::plugin::SendOutcome { powerhub::plugin::SendOutcome::Accepted }
/// # }
///
/// let hub = Hub::new(MySink, HubOptions::default())?;
/// let mut config = Config::default();
/// config.listeners.push(ListenerConfig::tcp("ndjson", "127.0.0.1:0"));
/// let engine = Engine::builder(config).hub(hub.clone()).start()?;
/// hub.publish_json("prices", &serde_json::json!({"type": "tick", "stream": "prices", "px": 1}))?;
/// engine.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct EngineBuilder {
    config: Config,
    registry: ProtocolRegistry,
    hub: Option<Hub>,
    factory: Arc<dyn MessageFactory>,
}

impl EngineBuilder {
    /// Serves protocols from `registry` (default: [`ProtocolRegistry::with_builtins`]).
    pub fn registry(mut self, registry: ProtocolRegistry) -> Self {
        self.registry = registry;
        self
    }

    /// Serves `hub` (default: a hub of its own, closed at shutdown, whose drain thread delivers
    /// to its library subscribers). A hub given here keeps its own driver; it is flushed at
    /// shutdown but left open.
    pub fn hub(mut self, hub: Hub) -> Self {
        self.hub = Some(hub);
        self
    }

    /// Serializes deliveries through `factory` (the push-stream spec's `createPushMessage`;
    /// default: the payload, byte-identical for every subscriber).
    pub fn message_factory(mut self, factory: Arc<dyn MessageFactory>) -> Self {
        self.factory = factory;
        self
    }

    /// Validates the config, binds the listeners and starts the shards.
    pub fn start(self) -> Result<Engine, EngineError> {
        Engine::start_inner(self)
    }
}

impl Engine {
    /// A builder for an engine on `config`.
    pub fn builder(config: Config) -> EngineBuilder {
        EngineBuilder {
            config,
            registry: ProtocolRegistry::with_builtins(),
            hub: None,
            factory: Arc::new(PayloadFactory),
        }
    }

    /// Validates `config`, binds its listeners (protocols looked up in `registry`), and starts
    /// the shards, serving a hub of its own ([`Engine::hub`]).
    pub fn start(config: Config, registry: &ProtocolRegistry) -> Result<Engine, EngineError> {
        Engine::builder(config).registry(registry.clone()).start()
    }

    fn start_inner(builder: EngineBuilder) -> Result<Engine, EngineError> {
        let EngineBuilder {
            config,
            registry,
            hub,
            factory,
        } = builder;
        config.validate()?;
        let backend = choose_backend(config.engine.backend)?;
        let o = &config.outbox;
        let outbox = OutboxConfig {
            coalesce_types: o.coalesce_types.clone(),
            drop_types: o.drop_types.clone(),
            high_water_bytes: o.high_water_bytes,
            keepalive_interval: Duration::from_millis(o.keepalive_interval_ms),
            liveness_timeout: Duration::from_millis(o.liveness_timeout_ms),
            framing: Framing::Protocol,
        };
        let limits = PushLimits::from_config(&config);
        let push_config = Arc::new(
            PushConfig::new(limits, outbox, factory)
                .map_err(|e| match e {
                    // `Config::validate` refuses these first, with the same words.
                    PushConfigError::Limits(PushLimitsError::Zero { field }) => {
                        EngineError::Config(ConfigError::Invalid {
                            key: format!("limits.{field}"),
                            value: "0".into(),
                            reason: "must be at least 1".into(),
                        })
                    }
                    PushConfigError::Outbox(e) => EngineError::Outbox(e.to_string()),
                })?
                // A run of publishes goes to the hub as one (`Request::PublishRun`).
                .with_publish_runs(true),
        );
        let n = config.shard_count();
        let mut handles = Vec::with_capacity(n);
        for index in 0..n {
            handles.push(Arc::new(
                ShardHandle::new(index).map_err(|source| EngineError::Shard { index, source })?,
            ));
        }
        // The engine's own hub drains on its own thread (for its library subscribers only), so
        // that no shard does more than the others.
        let owns_hub = hub.is_none();
        let hub = match hub {
            Some(h) => h,
            None => Hub::new(
                NoSink,
                HubOptions::default()
                    .batch_delay(config.engine.hub_batch_delay())
                    .driver(Driver::Thread)
                    .on_error(report_hub_error),
            )?,
        };
        let limits = &config.limits;
        let protocol_limits = ProtocolLimits::default()
            .with_max_message_bytes(limits.max_message_bytes)
            .with_max_handshake_bytes(limits.max_handshake_bytes);
        let mut specs = Vec::new();
        let mut fds = Vec::new();
        let mut bound = Vec::new();
        let mut unix_paths = Vec::new();
        let auth = config.auth.as_ref().map(auth_policy).transpose()?;
        // Every listener is prepared (its protocol, address and TLS files) before any is bound,
        // so that a configuration error exits before the server listens anywhere.
        let mut prepared = Vec::with_capacity(config.listeners.len());
        for (index, l) in config.listeners.iter().enumerate() {
            let factory = registry
                .get(&l.protocol)
                .map_err(|source| EngineError::Protocol { index, source })?;
            let origins = match &l.allowed_origins {
                Some(list) if list.iter().any(|o| o == "*") => OriginPolicy::Any,
                Some(list) => OriginPolicy::Listed(list.clone()),
                None if auth.is_some() => OriginPolicy::SameHost,
                None => OriginPolicy::Protocol,
            };
            let mut options = ListenerOptions::default().with_origins(origins);
            options.serve_page = l.serve_page;
            let factory = factory
                .for_listener(&options)
                .map_err(|message| EngineError::Listener { index, message })?
                .unwrap_or(factory);
            let addr = l.listen_addr(index)?;
            if let (Some(cert), ListenAddr::Unix(_)) = (&l.tls_cert, &addr) {
                return Err(EngineError::Config(ConfigError::Invalid {
                    key: format!("listener[{index}].tls_cert"),
                    value: cert.display().to_string(),
                    reason: "TLS is for TCP listeners; a Unix socket listener has none".into(),
                }));
            }
            let tls = listener_tls(l)
                .map_err(|source| EngineError::Tls { index, source })?
                .map(|(files, config)| (files, RwLock::new(config)));
            prepared.push((factory, addr, tls));
        }
        for (index, (l, (factory, addr, tls))) in config.listeners.iter().zip(prepared).enumerate()
        {
            let (fd, local) = bind(index, &l.protocol, &addr)?;
            if let ListenAddr::Unix(p) = &local {
                unix_paths.push(p.clone());
            }
            match &tls {
                Some(_) => tracing::info!(
                    protocol = %l.protocol,
                    addr = %local,
                    tls = %crate::security::tls::RecordLayer::current(),
                    "listening"
                ),
                None => tracing::info!(protocol = %l.protocol, addr = %local, "listening"),
            }
            bound.push(BoundListener {
                protocol: l.protocol.clone(),
                addr: local.clone(),
            });
            specs.push(ListenerSpec {
                factory,
                protocol_limits: protocol_limits.clone(),
                addr: local,
                tls,
            });
            fds.push(fd);
        }
        let session_config = Arc::new(SessionConfig {
            max_line_bytes: config.limits.max_message_bytes,
            max_subscriptions: config.limits.max_subscriptions_per_connection,
            max_json_depth: config.limits.max_json_depth,
            publish_messages_per_second: config.limits.publish_messages_per_second,
            publish_bytes_per_second: config.limits.publish_bytes_per_second,
            publish_violations_before_close: config.limits.publish_violations_before_close,
        });
        let shared = Arc::new(Shared {
            config,
            listeners: specs,
            shards: OnceLock::new(),
            counters: (0..handles.len())
                .map(|_| CachePadded::new(Counters::default()))
                .collect(),
            open: AtomicUsize::new(0),
            hub,
            push_config,
            next_conn_id: AtomicU64::new(1),
            next_owner: AtomicUsize::new(0),
            auth: RwLock::new(auth),
            session_config,
        });
        let _ = shared.shards.set(handles.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let mut threads = Vec::with_capacity(n);
        // Every shard accepts on every listener, each through a descriptor of its own for the
        // same socket: the kernel gives each connection to one of them.
        let mut per_shard = Vec::with_capacity(n);
        for index in 0..n {
            let copies = fds
                .iter()
                .map(|fd: &OwnedFd| fd.try_clone().map(Some))
                .collect::<io::Result<Vec<_>>>()
                .map_err(|source| EngineError::Shard { index, source })?;
            per_shard.push(copies);
        }
        drop(fds);
        for (handle, listeners) in handles.into_iter().zip(per_shard) {
            let index = handle.index;
            let shared = Arc::clone(&shared);
            let tx = tx.clone();
            let thread = std::thread::Builder::new()
                .name(format!("powerhub-shard-{index}"))
                .spawn(move || run_shard(handle, shared, listeners, backend, &tx))
                .map_err(|source| EngineError::Shard { index, source })?;
            threads.push(thread);
        }
        drop(tx);
        let mut engine = Engine {
            shared,
            threads,
            backend,
            bound,
            unix_paths,
            owns_hub,
            stats_stop: None,
            stats_thread: None,
            stopped: false,
        };
        // One kind for all the shards, or `Mixed`.
        let mut actual = None;
        for _ in 0..n {
            match rx.recv() {
                Ok(Ok(kind)) => {
                    actual = Some(match actual {
                        Some(seen) if seen != kind => BackendKind::Mixed,
                        _ => kind,
                    });
                }
                Ok(Err((index, source))) => {
                    engine.stop_now();
                    return Err(EngineError::Shard { index, source });
                }
                Err(_) => break,
            }
        }
        let actual = actual.unwrap_or(backend);
        engine.backend = actual;
        engine.start_stats_publisher();
        tracing::info!(backend = actual.as_str(), shards = n, "engine started");
        Ok(engine)
    }

    /// Publishes the counters to [`STATS_STREAM`] every `engine.stats_interval_ms`, while the
    /// stream has subscribers (the WebSocket plugin's web page shows them).
    fn start_stats_publisher(&mut self) {
        let interval = Duration::from_millis(self.shared.config.engine.stats_interval_ms);
        if interval.is_zero() {
            return;
        }
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let shared = Arc::clone(&self.shared);
        let backend = self.backend;
        let spawned = std::thread::Builder::new()
            .name("powerhub-stats".into())
            .spawn(move || {
                // Ends when the engine drops the sender.
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    rx.recv_timeout(interval)
                {
                    if shared.hub.presence(Some(STATS_STREAM)).is_empty() {
                        continue;
                    }
                    let json = stats_json(&shared, backend);
                    if let Ok(m) = crate::hub::Message::json(json) {
                        let _ = shared.hub.publish(
                            STATS_STREAM,
                            m,
                            crate::hub::PublishOptions::default(),
                        );
                    }
                }
            });
        match spawned {
            Ok(t) => {
                self.stats_stop = Some(tx);
                self.stats_thread = Some(t);
            }
            Err(e) => tracing::warn!(error = %e, "cannot start the stats publisher"),
        }
    }

    /// The hub the engine serves: publish into it from any thread.
    pub fn hub(&self) -> &Hub {
        &self.shared.hub
    }

    /// The backend the shards run (after probing and overrides).
    pub fn backend(&self) -> BackendKind {
        self.backend
    }

    /// The bound listeners, in config order.
    pub fn listeners(&self) -> &[BoundListener] {
        &self.bound
    }

    /// The configuration the engine runs.
    pub fn config(&self) -> &Config {
        &self.shared.config
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> EngineStats {
        self.shared.engine_stats()
    }

    /// Reads every TLS listener's certificate, key and client CA files again, for the
    /// connections accepted from now on (what `powerhub serve` does on SIGHUP); open
    /// connections keep the session they negotiated. All or nothing: if one listener's files
    /// cannot be used, no listener changes.
    ///
    /// # Errors
    ///
    /// The first listener whose files cannot be used ([`EngineError::Tls`]).
    pub fn reload_tls(&self) -> Result<(), EngineError> {
        let mut fresh = Vec::new();
        for (index, spec) in self.shared.listeners.iter().enumerate() {
            if let Some((files, _)) = &spec.tls {
                let config =
                    server_config(files).map_err(|source| EngineError::Tls { index, source })?;
                fresh.push((index, config));
            }
        }
        for (index, config) in fresh {
            if let Some((_, current)) = &self.shared.listeners[index].tls {
                *current.write() = config;
            }
        }
        Ok(())
    }

    /// Replaces the authentication of connections accepted from now on with one built from
    /// `auth` (its key files read again): what `powerhub serve` does on SIGHUP. Connections
    /// already open keep their identity and the policy they started with, keys included: one
    /// accepted before the reload that authenticates, or refreshes its token, afterwards is
    /// verified by the keys it started with (to take a token away from open connections, close
    /// them or restart). Authentication cannot be turned on or off by a reload (the listeners'
    /// origin policies depend on it).
    ///
    /// # Errors
    ///
    /// The new section cannot be used ([`EngineError::Auth`]; the old policy stays), or it
    /// turns authentication on or off ([`EngineError::Config`], naming `auth`).
    pub fn reload_auth(&self, auth: Option<&AuthConfig>) -> Result<(), EngineError> {
        if self.shared.auth.read().is_some() != auth.is_some() {
            return Err(EngineError::Config(ConfigError::Invalid {
                key: "auth".into(),
                value: if auth.is_some() { "present" } else { "absent" }.into(),
                reason: "a reload cannot turn authentication on or off; restart the server".into(),
            }));
        }
        let Some(config) = auth else {
            return Ok(());
        };
        // The key files are read with no lock held: a slow read (a network mount) holds up no
        // shard accepting a connection meanwhile. Only a reload turns authentication on or off
        // (it cannot), so the check above still holds.
        let mut fresh = auth_policy(config)?;
        let mut current = self.shared.auth.write();
        if let Some(old) = current.as_ref() {
            // Connections keep counting in their users' totals across the reload.
            fresh.users = Arc::clone(&old.users);
        }
        *current = Some(fresh);
        Ok(())
    }

    /// Graceful shutdown: stop accepting; keep reading and serving what the connections already
    /// sent until each has sent nothing for a moment (100 ms), or until a quarter of the budget
    /// is left; stop reading on every shard; deliver what was published by then to every
    /// connection; close each connection once its queue is written, with the
    /// `shutdown` error (WebSocket: then close 1001). All of it bounded by
    /// `engine.shutdown_timeout_ms`; then the shards stop.
    pub fn shutdown(mut self) -> Result<(), EngineError> {
        let budget = Duration::from_millis(self.shared.config.engine.shutdown_timeout_ms);
        let deadline = Instant::now() + budget;
        // The last quarter of the budget (at most a second) is kept for the close: each
        // connection's queue and its `shutdown` error are written then, even when clients
        // never stop sending (reading until the deadline left no time to say it).
        let read_until = deadline - (budget / 4).min(Duration::from_secs(1));
        for s in self.shared.shards() {
            s.send(ShardMsg::Drain { deadline });
        }
        // The shards keep reading until what the connections sent before the shutdown is read
        // (each goes quiet) or the reading time is up: what the server accepted is served.
        while Instant::now() < read_until && !self.shared.shards().iter().all(|s| s.is_quiet()) {
            std::thread::sleep(QUIET_POLL);
        }
        // Every shard stops reading before any finishes: a publish that one shard reads while
        // another already closed its connections would reach only some subscribers, and be
        // answered so. A shard stops at its next turn, so this waits for it even past a budget
        // too short for one (`shutdown_timeout_ms` = 0), up to `STOP_READING_WAIT`.
        for s in self.shared.shards() {
            s.send(ShardMsg::StopReading);
        }
        let stop_by = deadline.max(Instant::now() + STOP_READING_WAIT);
        while Instant::now() < stop_by
            && !self.shared.shards().iter().all(|s| s.has_stopped_reading())
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The hub's own subscribers get what was published before now (push subscriptions get
        // it at `Finish`, which fans out first). The wait is bounded: a hub given by the caller
        // may have sinks that never complete.
        let (tx, rx) = std::sync::mpsc::channel();
        let hub = self.shared.hub.clone();
        let flusher = std::thread::Builder::new()
            .name("powerhub-flush".into())
            .spawn(move || {
                let _ = tx.send(hub.flush());
            });
        if flusher.is_ok() {
            let wait = read_until.saturating_duration_since(Instant::now()) + TICK_GRACE;
            match rx.recv_timeout(wait) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "hub flush during shutdown reported errors")
                }
                Err(_) => tracing::warn!("hub flush did not finish by the shutdown deadline"),
            }
        }
        for s in self.shared.shards() {
            s.send(ShardMsg::Finish);
        }
        self.join();
        Ok(())
    }

    fn stop_now(&mut self) {
        let now = Instant::now();
        for s in self.shared.shards() {
            s.send(ShardMsg::Drain { deadline: now });
            s.send(ShardMsg::Finish);
        }
        self.join();
    }

    fn join(&mut self) {
        self.stats_stop = None;
        if let Some(t) = self.stats_thread.take() {
            let _ = t.join();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if self.owns_hub {
            self.shared.hub.close();
        }
        for p in self.unix_paths.drain(..) {
            let _ = std::fs::remove_file(p);
        }
        self.stopped = true;
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        if !self.stopped {
            self.stop_now();
        }
    }
}

type Started = Result<BackendKind, (usize, io::Error)>;

/// Runs a shard on its thread. A panic that escapes the shard's own handling ends the process:
/// a server with a dead shard would accept connections it never serves, while a process that
/// exits is restarted by its supervisor.
fn run_shard(
    handle: Arc<ShardHandle>,
    shared: Arc<Shared>,
    listeners: Vec<Option<OwnedFd>>,
    backend: BackendKind,
    started: &std::sync::mpsc::Sender<Started>,
) {
    let index = handle.index;
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_shard_loop(handle, shared, listeners, backend, started)
    }));
    if let Err(panic) = ran {
        tracing::error!(
            shard = index,
            panic = %crate::hub::panic_message(&*panic),
            "a shard panicked; the server cannot go on without it and aborts"
        );
        std::process::abort();
    }
}

fn run_shard_loop(
    handle: Arc<ShardHandle>,
    shared: Arc<Shared>,
    listeners: Vec<Option<OwnedFd>>,
    backend: BackendKind,
    started: &std::sync::mpsc::Sender<Started>,
) {
    let index = handle.index;
    let waker = Shard::<sys::epoll::Epoll>::waker_fd(&handle);
    if backend == BackendKind::IoUring {
        match sys::uring::Uring::new(waker, shared.config.limits.max_connections) {
            Ok(ring) => {
                let _ = started.send(Ok(BackendKind::IoUring));
                Shard::new(handle, shared, ring, listeners).run();
                return;
            }
            Err(e) => {
                tracing::warn!(shard = index, error = %e, "cannot set up io_uring; this shard runs epoll")
            }
        }
    }
    match sys::epoll::Epoll::new(waker) {
        Ok(epoll) => {
            let _ = started.send(Ok(BackendKind::Epoll));
            Shard::new(handle, shared, epoll, listeners).run();
        }
        Err(e) => {
            let _ = started.send(Err((index, e)));
        }
    }
}
