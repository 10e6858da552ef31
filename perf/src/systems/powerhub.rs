//! powerhub as a system under test: the `powerhub serve` push server (NDJSON over TCP), and
//! the in-process hub (`powerhub::hub::Hub`).
//!
//! Everything that depends on the server's command line, configuration and push protocol is
//! in this module.

use std::io::{self, BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use powerhub::hub::{Codec, Hub, HubOptions, Message, PublishOptions, SubscribeOptions};
use powerhub::plugin::{Completion, Frame, SendOutcome, Sink, SubscriberRef};

use super::raw::LineDecoder;
use super::{find_end, request, Decoder, Policy, Stream, SystemKind, Target, Wire};
use crate::inproc::InprocOut;

/// The static token of the `powerhub-auth` system (see [`AUTH_SECTION`]).
const TOKEN: &str = "perf-token-with-every-permission";

/// The `[auth]` section of the `powerhub-auth` system: one static token that may publish and
/// subscribe everywhere (every command is still checked against the patterns).
const AUTH_SECTION: &str = r#"
[[auth.tokens]]
token = "perf-token-with-every-permission"
user = "perf"
permissions = { publish = { allow = [">"] }, subscribe = { allow = [">"] } }
"#;

/// The NDJSON push protocol of `powerhub serve` (`docs/protocol.md`).
#[derive(Debug, Default)]
pub(crate) struct PowerhubWire {
    /// Authenticate every connection first (the `powerhub-auth` system).
    auth: bool,
}

impl PowerhubWire {
    /// The wire of a server with authentication on.
    pub(crate) fn with_token() -> PowerhubWire {
        PowerhubWire { auth: true }
    }

    /// The `auth` command every connection sends first, if any.
    fn hello(&self) -> String {
        if self.auth {
            format!("{{\"type\":\"auth\",\"token\":\"{TOKEN}\"}}\n")
        } else {
            String::new()
        }
    }
}

impl Wire for PowerhubWire {
    fn subscribe(&self, s: &mut dyn Stream, topic: &str) -> io::Result<Vec<u8>> {
        // The slow-consumer policy is the server's `[subscriptions] slow_consumer`: see `Launcher`.
        let cmd = format!(
            "{}{{\"type\":\"subscribe\",\"id\":\"s\",\"stream\":\"{topic}\"}}\n",
            self.hello()
        );
        let rest = request(s, cmd.as_bytes(), "powerhub `subscribed` reply", |b| {
            if memchr::memmem::find(b, b"\"type\":\"error\"").is_some() {
                return find_end(b, b"\n").map(|_| 0);
            }
            let at = memchr::memmem::find(b, b"\"type\":\"subscribed\"")?;
            find_end(&b[at..], b"\n").map(|e| at + e)
        })?;
        if rest.starts_with(b"{") && memchr::memmem::find(&rest, b"\"type\":\"error\"").is_some() {
            return Err(io::Error::other(format!(
                "subscribe refused: {}",
                String::from_utf8_lossy(&rest).trim_end()
            )));
        }
        Ok(rest)
    }

    fn hello_publisher(&self, s: &mut dyn Stream) -> io::Result<()> {
        let cmd = format!("{}{{\"type\":\"ping\",\"id\":1}}\n", self.hello());
        request(s, cmd.as_bytes(), "powerhub `pong` reply", |b| {
            let at = memchr::memmem::find(b, b"\"type\":\"pong\"")?;
            find_end(&b[at..], b"\n").map(|e| at + e)
        })
        .map(drop)
    }

    fn encode_publish(&self, _topic: &str, msg: &[u8], out: &mut Vec<u8>) {
        // The message names its stream (topic) itself; it is delivered byte for byte.
        out.extend_from_slice(b"{\"type\":\"publish\",\"message\":");
        out.extend_from_slice(msg);
        out.extend_from_slice(b"}\n");
    }

    fn decoder(&self) -> Box<dyn Decoder> {
        // Delivered messages, replies, pings and notifications: one JSON object per line; the
        // server's keepalive ping is answered.
        Box::new(LineDecoder {
            ping: Some((b"{\"type\":\"ping\"}", b"{\"type\":\"pong\"}\n")),
        })
    }
}

/// How to start `powerhub serve`.
#[derive(Debug, Clone)]
pub(crate) struct Launcher {
    pub(crate) bin: PathBuf,
    /// Shards (worker threads).
    pub(crate) shards: usize,
    /// CPU the server is pinned to, if any.
    pub(crate) pin: Option<usize>,
    /// Where the config file and the server log go.
    pub(crate) dir: PathBuf,
    /// The certificate of the `powerhub-tls` system, when it runs.
    pub(crate) tls: Option<crate::tls::TlsFiles>,
    /// How long a started server may take to say `ready` (`--ready-timeout`).
    pub(crate) ready_wait: Duration,
}

impl Launcher {
    /// Start a server with the io backend of `kind` (default, or epoll) configured for
    /// `flavor`.
    pub(crate) fn start(&self, kind: SystemKind, flavor: Flavor) -> io::Result<Target> {
        let backend = if kind == SystemKind::PowerhubEpoll {
            "epoll"
        } else {
            "auto"
        };
        let auth = match kind {
            SystemKind::PowerhubAuth => "-auth",
            SystemKind::PowerhubTls => "-tls",
            _ => "",
        };
        let name = format!("powerhub-{backend}{auth}-{}", flavor.name());
        let config = self.dir.join(format!("{name}.toml"));
        let mut text = config_text(self.shards, backend, flavor);
        let tls = match (kind, &self.tls) {
            (SystemKind::PowerhubTls, Some(files)) => {
                // The listener is the config's last section.
                text.push_str(&format!(
                    "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
                    files.cert.display(),
                    files.key.display()
                ));
                Some(Arc::clone(&files.client))
            }
            (SystemKind::PowerhubTls, None) => {
                return Err(io::Error::other("powerhub-tls: no test certificate made"))
            }
            _ => None,
        };
        if kind == SystemKind::PowerhubAuth {
            text.push_str(AUTH_SECTION);
        }
        std::fs::write(&config, text)?;
        let log = std::fs::File::create(self.dir.join(format!("{name}.log")))?;
        let mut child = crate::procfs::die_with_tool(&mut Command::new(&self.bin))
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| {
                io::Error::new(e.kind(), format!("cannot run {}: {e}", self.bin.display()))
            })?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| io::Error::other("no stdout"))?;
        // Read on a thread of its own, which goes on reading once the server is ready (so that
        // it never blocks on its stdout): the wait for `ready` is bounded.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                // Once the start gave up or the server is ready nobody listens: read on.
                let _ = tx.send(line);
            }
        });
        let deadline = Instant::now() + self.ready_wait;
        let mut addr: Option<SocketAddr> = None;
        let mut backend = String::new();
        let mut said = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match rx.recv_timeout(left) {
                Ok(Ok(line)) => line,
                Ok(Err(e)) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(e);
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!(
                            "{} serve said no `ready` within --ready-timeout = {} s (said \
                             {said:?}; log in {name}.log): is it a powerhub binary?",
                            self.bin.display(),
                            self.ready_wait.as_secs_f64()
                        ),
                    ));
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(io::Error::other(format!(
                        "powerhub serve exited before `ready` (said {said:?}; log in {name}.log)"
                    )));
                }
            };
            if let Some(a) = line.strip_prefix("listening ndjson ") {
                addr = a.trim().parse().ok();
            }
            if let Some(b) = line.strip_prefix("backend ") {
                backend = b.trim().to_owned();
            }
            if line.trim() == "ready" {
                break;
            }
            said.push(line);
        }
        let addr = addr.ok_or_else(|| {
            io::Error::other(format!(
                "powerhub serve printed no ndjson listener: {said:?}"
            ))
        })?;
        let pid = child.id();
        if let Some(cpu) = self.pin {
            crate::procfs::pin(Some(pid), &[cpu])?;
        }
        Ok(Target {
            kind,
            addr,
            pid,
            wire: kind.wire(),
            backend,
            child: Some(child),
            policies: Policy::ALL.to_vec(),
            tls,
        })
    }
}

/// What a server is started for.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Flavor {
    /// Throughput and latency: the default policy, subscription queues as deep as the load
    /// generator's window (16384 messages of 64 B in flight per subscriber). Redis and NATS
    /// buffer that much per subscriber without a bound, so powerhub gets the same room instead
    /// of dropping by policy.
    Throughput,
    /// Every push subscription with this slow-consumer policy and a queue of this many
    /// messages.
    Policy(Policy, usize),
    /// This many idle connections with the keepalive running: a ping every second; at least
    /// [`IDLE_SHARDS`] shards, and enough of them to hold every connection as a direct
    /// descriptor (see [`idle_shards`]).
    Idle(usize),
}

impl Flavor {
    fn name(self) -> &'static str {
        match self {
            Flavor::Throughput => "throughput",
            Flavor::Policy(p, _) => p.name(),
            Flavor::Idle(_) => "idle",
        }
    }
}

/// Shards of a server for idle connections, at least.
pub(crate) const IDLE_SHARDS: usize = 2;

/// Keepalive pings a second an idle server is asked to answer at most (with their pongs, each a
/// loopback TCP segment: about 25 µs of a CPU for the pair, most of it in the kernel).
const IDLE_PINGS_PER_SEC: usize = 25_000;

/// The keepalive interval of an idle server of `connections`: a ping a second on each, or fewer
/// where that would pass [`IDLE_PINGS_PER_SEC`] (100 000 connections: one every 4 s), so that
/// the machine that also runs the holders keeps up with the pings.
pub(crate) fn idle_keepalive(connections: usize) -> Duration {
    let ms = (connections * 1000).div_ceil(IDLE_PINGS_PER_SEC).max(1000);
    Duration::from_millis(ms as u64)
}

/// Shards a server needs to keep `connections` as io_uring direct descriptors: each shard's
/// table of them is at most the descriptor limit (see the engine's io_uring backend), less
/// what the process keeps for its own files, and a server assigns new connections to its shards
/// round-robin. At least [`IDLE_SHARDS`], at most [`MAX_IDLE_SHARDS`]; [`IDLE_SHARDS`] where
/// the limit leaves a shard fewer than 1 024 connections (or could not be read), as a server
/// that keeps them as ordinary descriptors gets.
pub(crate) fn idle_shards(connections: usize, nofile: u64) -> usize {
    let per_shard = usize::try_from(nofile.saturating_sub(1024)).unwrap_or(usize::MAX);
    if per_shard < 1024 {
        return IDLE_SHARDS;
    }
    connections
        .div_ceil(per_shard)
        .clamp(IDLE_SHARDS, MAX_IDLE_SHARDS)
}

/// The most shards an idle server is given (1 200 000 connections under a limit of 20 000).
const MAX_IDLE_SHARDS: usize = 64;

fn config_text(shards: usize, backend: &str, flavor: Flavor) -> String {
    // Idle connections: enough shards that every connection is a direct descriptor on io_uring,
    // so the server holds more connections than one process may open descriptors. The process
    // stays pinned to the one server CPU like every other server.
    let (shards, max_connections) = match flavor {
        Flavor::Idle(n) => (
            shards.max(idle_shards(n, crate::procfs::nofile_hard())),
            n.max(100_000),
        ),
        _ => (shards, 100_000),
    };
    let tuning = match flavor {
        Flavor::Throughput => "[subscriptions]\nmax_queue = 16384\n".to_owned(),
        Flavor::Policy(p, queue) => format!(
            "[subscriptions]\nslow_consumer = \"{}\"\nmax_queue = {queue}\n",
            p.name()
        ),
        Flavor::Idle(n) => format!(
            "[outbox]\nkeepalive_interval_ms = {}\n",
            idle_keepalive(n).as_millis()
        ),
    };
    format!(
        r#"# Written by powerhub-perf.
[engine]
shards = {shards}
backend = "{backend}"

[limits]
max_connections = {max_connections}
# Screenshot frames of up to 2 MiB inside a publish command.
max_message_bytes = 16777216

{tuning}

[[listener]]
protocol = "ndjson"
address = "127.0.0.1:0"
"#
    )
}

/// The workspace's release binary.
pub(crate) fn default_bin() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/release/powerhub")
}

/// A sink that takes every frame at once (an in-process consumer with nothing to do).
#[derive(Debug, Default)]
struct Accepting;

impl Sink for Accepting {
    fn send(&self, _sub: &SubscriberRef, _frame: Frame, _done: Completion) -> SendOutcome {
        SendOutcome::Accepted
    }
}

/// An in-process hub whose drain thread runs on the CPU `pin` pins to (the drain thread
/// inherits the CPU of the thread that creates the hub).
fn pinned_hub(pin: fn(), inline_handlers: bool) -> io::Result<Hub> {
    std::thread::scope(|s| {
        s.spawn(|| {
            pin();
            let opts = HubOptions::default()
                .codec(Codec::Ndjson)
                .inline_handlers(inline_handlers);
            Hub::new(Accepting, opts)
        })
        .join()
        .map_err(|_| io::Error::other("hub creation panicked"))
    })?
    .map_err(|e| io::Error::other(e.to_string()))
}

/// A hub error as the perf tool's I/O error.
fn hub_error(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Publish `msgs` copies of `payload` to `n` subscribers of an in-process hub (its own drain
/// thread; handlers on its handler pool, or on the drain thread with `inline_handlers`) and wait
/// until every subscriber has them. Each subscriber's handler counts its deliveries; the
/// publisher stays within half a queue of the drain, as with the other in-process systems, so
/// that nothing is dropped.
pub(crate) fn inproc(
    n: usize,
    msgs: u64,
    queue: usize,
    payload: Bytes,
    inline_handlers: bool,
) -> io::Result<InprocOut> {
    let hub = pinned_hub(crate::inproc::pin_consumer, inline_handlers)?;
    // One counter per subscriber, written only by its handler, which runs for one batch at a
    // time (the hub orders its runs): a plain load and store, no locked instruction. The
    // publisher reads them to stay within half a queue of the slowest.
    let counters: Vec<Arc<AtomicU64>> = (0..n).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let mut subs = Vec::with_capacity(n);
    for c in &counters {
        let d = c.clone();
        let handler = move |_: &powerhub::hub::Delivery<'_>| {
            d.store(d.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        };
        // The default policy (drop-oldest); the publisher's window keeps it from acting.
        let opts = SubscribeOptions::default().max_queue(queue).max_batch(64);
        subs.push(
            hub.subscribe(crate::scenarios::BENCH, handler, opts)
                .map_err(hub_error)?,
        );
    }
    let slowest = || {
        counters
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    };
    let message = Message::json(payload).map_err(hub_error)?;
    let window = (queue / 2).max(1) as u64;
    let start = Instant::now();
    let mut floor = 0;
    for i in 0..msgs {
        while i >= floor + window {
            floor = slowest();
            if i >= floor + window {
                std::thread::yield_now();
            }
        }
        hub.publish(
            crate::scenarios::BENCH,
            message.clone(),
            PublishOptions::default(),
        )
        .map_err(hub_error)?;
    }
    hub.flush().map_err(hub_error)?;
    let secs = start.elapsed().as_secs_f64();
    let stats = hub.stats();
    hub.close();
    let delivered = counters.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    Ok(InprocOut {
        delivered,
        lost: stats.dropped,
        secs,
    })
}

/// [`inproc`] with a [`Receiver`](powerhub::hub::Receiver) per subscriber: one consumer thread
/// (on the consumer CPU, as the other systems' consumers) drains every receiver with
/// `try_recv` (an owned message per receive, as broadcast's), or with `try_recv_ref` when
/// `borrowed` (the message borrowed from the shared batch), as the broadcast and channel
/// systems are drained.
pub(crate) fn inproc_receivers(
    n: usize,
    msgs: u64,
    queue: usize,
    payload: Bytes,
    borrowed: bool,
) -> io::Result<InprocOut> {
    use powerhub::hub::TryRecvError;
    // The hub's drain thread runs with the publisher (which yields while it is a window
    // ahead), not with the consumer, which spins over its receivers: there is a third thread
    // here, and two CPUs.
    let hub = pinned_hub(crate::inproc::pin_publisher, false)?;
    let mut rxs = Vec::with_capacity(n);
    for _ in 0..n {
        let opts = SubscribeOptions::default().max_queue(queue).max_batch(64);
        rxs.push(
            hub.receiver(crate::scenarios::BENCH, opts)
                .map_err(hub_error)?,
        );
    }
    // Everything the consumer read, and the smallest per-receiver count, for the window.
    let floor = Arc::new(AtomicU64::new(0));
    let consumer_floor = Arc::clone(&floor);
    let start = Instant::now();
    let consumer = std::thread::spawn(move || {
        crate::inproc::pin_consumer();
        let mut counts = vec![0u64; rxs.len()];
        let (mut delivered, mut lost) = (0u64, 0u64);
        let mut open = rxs.len();
        while open > 0 {
            open = 0;
            for (rx, count) in rxs.iter_mut().zip(counts.iter_mut()) {
                loop {
                    let got = if borrowed {
                        rx.try_recv_ref().map(|d| {
                            std::hint::black_box(&d.message().bytes()[..]);
                        })
                    } else {
                        // As every in-process consumer: the message's bytes read, then dropped.
                        rx.try_recv().map(|m| {
                            std::hint::black_box(&m.message().bytes()[..]);
                        })
                    };
                    match got {
                        Ok(()) => {
                            delivered += 1;
                            *count += 1;
                        }
                        Err(TryRecvError::Empty) => {
                            open += 1;
                            break;
                        }
                        Err(TryRecvError::Lagged { missed }) => lost += missed,
                        Err(_) => break,
                    }
                }
            }
            // Stored only when it moved (as the broadcast consumer's): an idle pass writes no
            // line the publisher reads.
            let min = counts.iter().copied().min().unwrap_or(0);
            if min != consumer_floor.load(Ordering::Relaxed) {
                consumer_floor.store(min, Ordering::Release);
            }
        }
        (delivered, lost)
    });
    let message = Message::json(payload).map_err(hub_error)?;
    let window = (queue / 2).max(1) as u64;
    // The topic's publisher handle, as broadcast's sender.
    let publisher = hub.publisher(crate::scenarios::BENCH);
    for i in 0..msgs {
        while i >= floor.load(Ordering::Acquire) + window {
            std::thread::yield_now();
        }
        publisher
            .publish(message.clone(), PublishOptions::default())
            .map_err(hub_error)?;
    }
    drop(publisher);
    // Every message handed over, then the receivers end (Closed) once they have read it.
    while floor.load(Ordering::Acquire) < msgs {
        std::thread::yield_now();
    }
    let secs = start.elapsed().as_secs_f64();
    hub.close();
    let (delivered, lost) = consumer
        .join()
        .map_err(|_| io::Error::other("consumer panicked"))?;
    Ok(InprocOut {
        delivered,
        lost,
        secs,
    })
}

#[cfg(test)]
mod tests {
    use super::{config_text, idle_keepalive, idle_shards, Flavor, IDLE_SHARDS};
    use std::time::Duration;

    #[test]
    fn an_idle_server_has_a_direct_descriptor_table_for_every_connection() {
        // 20 000 descriptors, 1 024 kept: 18 976 connections a shard.
        assert_eq!(idle_shards(50_000, 20_000), 3);
        assert_eq!(idle_shards(100_000, 20_000), 6);
        assert_eq!(idle_shards(18_976, 20_000), IDLE_SHARDS);
        assert_eq!(idle_shards(1, 1_000_000), IDLE_SHARDS);
        assert_eq!(idle_shards(10, 0), IDLE_SHARDS, "no limit read");
        assert_eq!(
            idle_shards(50_000, 1024),
            IDLE_SHARDS,
            "a limit that leaves no room"
        );
        assert_eq!(idle_shards(50_000, 2047), IDLE_SHARDS);
        assert_eq!(idle_shards(50_000, 2048), 49);
        assert_eq!(idle_shards(10_000_000, 20_000), 64, "at most 64");
        let text = config_text(1, "auto", Flavor::Idle(250_000));
        assert!(text.contains("max_connections = 250000"), "{text}");
        assert!(text.contains("keepalive_interval_ms = 10000"), "{text}");
        assert_eq!(idle_keepalive(50_000), Duration::from_secs(2));
        assert_eq!(idle_keepalive(100_000), Duration::from_secs(4));
        assert_eq!(idle_keepalive(10_000), Duration::from_secs(1));
        let text = config_text(4, "auto", Flavor::Throughput);
        assert!(text.contains("shards = 4\n") && text.contains("max_connections = 100000"));
    }
}
