//! The systems under test and the thin raw-protocol clients that talk to them.
//!
//! Each system is reached through a [`Wire`]: how a connection subscribes, how a publisher
//! frames a message, and a [`Decoder`] that pulls delivered messages out of the byte stream.
//! The load generator drives every system through this one interface with the same pipelining
//! depth and reader threads.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub(crate) use crate::tls::Link;

pub(crate) mod nats;
pub(crate) mod powerhub;
pub(crate) mod raw;
pub(crate) mod redis;

/// Which system a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum SystemKind {
    /// `powerhub serve` with its default io backend (io_uring where the kernel allows it).
    Powerhub,
    /// `powerhub serve` with the epoll backend.
    PowerhubEpoll,
    /// `powerhub serve` (default backend) with authentication on: every connection presents a
    /// static token first, and every subscribe and publish is checked against its permissions.
    PowerhubAuth,
    /// `powerhub serve` (default backend) with TLS on its NDJSON listener (rustls, TLS 1.3).
    PowerhubTls,
    Redis,
    Nats,
    /// `nats-server` with TLS, started by the perf tool (the client upgrades after `INFO`).
    NatsTls,
    Raw,
}

impl SystemKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            SystemKind::Powerhub => "powerhub",
            SystemKind::PowerhubEpoll => "powerhub-epoll",
            SystemKind::PowerhubAuth => "powerhub-auth",
            SystemKind::PowerhubTls => "powerhub-tls",
            SystemKind::Redis => "redis",
            SystemKind::Nats => "nats",
            SystemKind::NatsTls => "nats-tls",
            SystemKind::Raw => "raw-writev",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<SystemKind> {
        match s {
            "powerhub" => Some(SystemKind::Powerhub),
            "powerhub-epoll" => Some(SystemKind::PowerhubEpoll),
            "powerhub-auth" => Some(SystemKind::PowerhubAuth),
            "powerhub-tls" => Some(SystemKind::PowerhubTls),
            "redis" => Some(SystemKind::Redis),
            "nats" => Some(SystemKind::Nats),
            "nats-tls" => Some(SystemKind::NatsTls),
            "raw" | "raw-writev" => Some(SystemKind::Raw),
            _ => None,
        }
    }
}

impl SystemKind {
    /// The client side of this system's protocol.
    pub(crate) fn wire(self) -> Arc<dyn Wire> {
        match self {
            SystemKind::Powerhub | SystemKind::PowerhubEpoll | SystemKind::PowerhubTls => {
                Arc::new(powerhub::PowerhubWire::default())
            }
            SystemKind::PowerhubAuth => Arc::new(powerhub::PowerhubWire::with_token()),
            SystemKind::Redis => Arc::new(redis::RedisWire),
            SystemKind::Nats | SystemKind::NatsTls => Arc::new(nats::NatsWire),
            SystemKind::Raw => Arc::new(raw::RawWire),
        }
    }

    /// Whether this is powerhub (ratios are taken from it).
    pub(crate) fn is_powerhub(self) -> bool {
        matches!(
            self,
            SystemKind::Powerhub
                | SystemKind::PowerhubEpoll
                | SystemKind::PowerhubAuth
                | SystemKind::PowerhubTls
        )
    }

    /// Whether clients reach this system over TLS.
    pub(crate) fn is_tls(self) -> bool {
        matches!(self, SystemKind::PowerhubTls | SystemKind::NatsTls)
    }
}

impl fmt::Display for SystemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The slow-consumer policy asked of a subscription (only powerhub has them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Policy {
    DropOldest,
    DropNewest,
    Disconnect,
}

impl Policy {
    pub(crate) const ALL: [Policy; 3] =
        [Policy::DropOldest, Policy::DropNewest, Policy::Disconnect];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Policy::DropOldest => "drop-oldest",
            Policy::DropNewest => "drop-newest",
            Policy::Disconnect => "disconnect",
        }
    }
}

/// A blocking connection a [`Wire`] talks over: a socket, or TLS over one.
pub(crate) trait Stream: Read + Write {}

impl<T: Read + Write> Stream for T {}

/// How to talk to one system.
pub(crate) trait Wire: Send + Sync {
    /// Subscribe a fresh connection to `topic` and return once the server confirmed it, with any
    /// bytes read past the confirmation.
    fn subscribe(&self, s: &mut dyn Stream, topic: &str) -> io::Result<Vec<u8>>;
    /// Prepare a fresh connection for publishing.
    fn hello_publisher(&self, s: &mut dyn Stream) -> io::Result<()>;
    /// Append the bytes that publish `msg` on `topic`.
    fn encode_publish(&self, topic: &str, msg: &[u8], out: &mut Vec<u8>);
    /// A decoder for one subscriber connection.
    fn decoder(&self) -> Box<dyn Decoder>;
}

/// Pulls delivered messages out of one connection's byte stream.
pub(crate) trait Decoder: Send {
    /// Decode every complete message at the start of `buf`, handing each delivered message to
    /// `on_msg` and appending any reply the protocol requires (a PONG) to `reply`. Returns the
    /// number of bytes consumed.
    fn decode(
        &mut self,
        buf: &[u8],
        on_msg: &mut dyn FnMut(&[u8]),
        reply: &mut Vec<u8>,
    ) -> io::Result<usize>;
}

/// A running system: where it listens, the process to measure, and how to talk to it.
pub(crate) struct Target {
    pub(crate) kind: SystemKind,
    pub(crate) addr: SocketAddr,
    pub(crate) pid: u32,
    pub(crate) wire: Arc<dyn Wire>,
    /// The io backend powerhub reported (`io_uring` or `epoll`); empty for other systems.
    pub(crate) backend: String,
    /// Set when the perf tool started the process itself (stopped on drop).
    pub(crate) child: Option<Child>,
    /// Slow-consumer policies this system can be asked for.
    pub(crate) policies: Vec<Policy>,
    /// The client configuration of a TLS system (`None`: plaintext).
    pub(crate) tls: Option<Arc<rustls::ClientConfig>>,
}

impl Target {
    /// A fresh connection, through TLS for a TLS system (NATS: after its plaintext `INFO`,
    /// which the link reads again first).
    pub(crate) fn open(&self) -> io::Result<Link> {
        let mut tcp = connect(self.addr)?;
        let Some(config) = &self.tls else {
            return Ok(Link::Plain(tcp));
        };
        let mut replay = Vec::new();
        if self.kind == SystemKind::NatsTls {
            let rest = read_until(&mut tcp, &mut replay, "NATS INFO", |b| find_end(b, b"\r\n"))?;
            if !rest.is_empty() {
                return Err(io::Error::other(
                    "NATS sent more than INFO before the TLS upgrade",
                ));
            }
        }
        let mut link = Link::tls(tcp, config, replay)?;
        if let Link::Tls { tcp, tls, .. } = &mut link {
            // The handshake now, so that a TLS failure is said as one.
            while tls.is_handshaking() {
                tls.complete_io(tcp)
                    .map_err(|e| io::Error::new(e.kind(), format!("TLS handshake: {e}")))?;
            }
        }
        Ok(link)
    }
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("kind", &self.kind)
            .field("addr", &self.addr)
            .field("pid", &self.pid)
            .finish()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            // SAFETY: kill has no memory-safety preconditions; the pid is our own child.
            unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(3);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Connect with `TCP_NODELAY` and a handshake timeout.
pub(crate) fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .map_err(|e| io::Error::new(e.kind(), format!("cannot connect to {addr}: {e}")))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    Ok(s)
}

/// Read from `s` into `buf` until `done(buf)` returns the length of the handshake answer.
pub(crate) fn read_until(
    s: &mut dyn Stream,
    buf: &mut Vec<u8>,
    what: &str,
    done: impl Fn(&[u8]) -> Option<usize>,
) -> io::Result<Vec<u8>> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = done(buf) {
            return Ok(buf.split_off(end));
        }
        let n = s
            .read(&mut chunk)
            .map_err(|e| io::Error::new(e.kind(), format!("waiting for {what}: {e}")))?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "connection closed while waiting for {what}: {:?}",
                    String::from_utf8_lossy(buf)
                ),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// Write all of `bytes`, then wait for the answer `done` recognises.
pub(crate) fn request(
    s: &mut dyn Stream,
    bytes: &[u8],
    what: &str,
    done: impl Fn(&[u8]) -> Option<usize>,
) -> io::Result<Vec<u8>> {
    s.write_all(bytes)?;
    let mut buf = Vec::new();
    read_until(s, &mut buf, what, done)
}

/// The end of the first occurrence of `needle` in `hay`.
pub(crate) fn find_end(hay: &[u8], needle: &[u8]) -> Option<usize> {
    memchr::memmem::find(hay, needle).map(|i| i + needle.len())
}
