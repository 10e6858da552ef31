//! Helpers shared by the engine's integration tests: run a body on both IO backends, start an
//! engine on loopback, and a line-oriented client with bounded waits.
#![allow(dead_code, unreachable_pub, missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use powerhub::runtime::{
    BackendChoice, BackendKind, Config, Engine, ListenAddr, ListenerConfig, ProtocolRegistry,
};

/// How long any single wait in a test may take before the test fails (a bound, not a timing
/// assertion: a healthy run finishes each wait in milliseconds).
pub const WAIT: Duration = Duration::from_secs(20);

/// Runs `body` once with the backend forced to io_uring and once forced to epoll. If the kernel
/// refuses io_uring (or `POWERHUB_BACKEND=epoll` is set) the io_uring run is skipped with a
/// printed notice.
pub fn on_both_backends(body: impl Fn(BackendChoice)) {
    for choice in [BackendChoice::IoUring, BackendChoice::Epoll] {
        if choice == BackendChoice::IoUring {
            let probe = start(base_config(choice));
            let kind = probe.engine.backend();
            drop(probe);
            if kind != BackendKind::IoUring {
                eprintln!("notice: io_uring is not available here (kernel refused it or it is forced off); io_uring run skipped");
                continue;
            }
        }
        eprintln!("--- backend {choice:?}");
        body(choice);
    }
}

/// A config with one ndjson TCP listener on a free loopback port, two shards, short deadlines.
pub fn base_config(backend: BackendChoice) -> Config {
    let mut c = Config::default();
    c.engine.backend = backend;
    c.engine.shards = 2;
    c.engine.shutdown_timeout_ms = 3000;
    c.listeners
        .push(ListenerConfig::tcp("ndjson", "127.0.0.1:0"));
    c
}

pub struct Server {
    pub engine: Engine,
    pub addr: SocketAddr,
}

pub fn start(config: Config) -> Server {
    start_with(config, &ProtocolRegistry::with_builtins())
}

pub fn start_with(config: Config, registry: &ProtocolRegistry) -> Server {
    let engine = Engine::start(config, registry).expect("engine starts");
    let addr = match &engine.listeners()[0].addr {
        ListenAddr::Tcp(a) => *a,
        other => panic!("first listener is not TCP: {other}"),
    };
    Server { engine, addr }
}

/// Polls `cond` until it holds or [`WAIT`] passes; panics naming `what` on timeout.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whole seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock past 1970")
        .as_secs()
}

/// A blocking NDJSON client over TCP.
pub struct Client {
    pub reader: BufReader<TcpStream>,
    pub writer: TcpStream,
}

impl Client {
    pub fn connect(addr: SocketAddr) -> Client {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).unwrap();
        stream.set_nodelay(true).unwrap();
        Client {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    pub fn send(&mut self, line: &str) {
        self.writer.write_all(line.as_bytes()).unwrap();
        self.writer.write_all(b"\n").unwrap();
    }

    pub fn send_raw(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).unwrap();
    }

    /// The next line, without its newline; `None` at end of stream.
    pub fn line(&mut self) -> Option<String> {
        let mut s = String::new();
        match self.reader.read_line(&mut s) {
            Ok(0) => None,
            Ok(_) => {
                assert!(s.ends_with('\n'), "line ended without newline: {s:?}");
                s.pop();
                Some(s)
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => None,
            Err(e) => panic!("read failed: {e}"),
        }
    }

    pub fn json(&mut self) -> serde_json::Value {
        let line = self.line().expect("a line before end of stream");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
    }

    /// Reads until end of stream, returning what was left; a reset counts as the end.
    pub fn rest(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match self.reader.read(&mut buf) {
                Ok(0) => return out,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return out,
                Err(e) => panic!("read failed: {e}"),
            }
        }
    }
}

impl Client {
    /// The next message that is not a keepalive `ping`.
    pub fn msg(&mut self) -> serde_json::Value {
        loop {
            let v = self.json();
            if v["type"] != "ping" {
                return v;
            }
        }
    }

    /// Subscribes to every device of `stream`; returns the subscription id.
    pub fn subscribe(&mut self, stream: &str) -> String {
        self.send(&format!(
            r#"{{"type":"subscribe","id":"sub-{stream}","stream":"{stream}"}}"#
        ));
        let v = self.msg();
        assert_eq!(v["type"], "subscribed", "{v}");
        v["subscriptionId"]
            .as_str()
            .expect("subscriptionId")
            .to_owned()
    }
}

/// A message of `stream` carrying sequence number `seq` and `pad` bytes of padding.
pub fn message(stream: &str, seq: u64, pad: usize) -> String {
    format!(
        r#"{{"type":"tick","stream":"{stream}","seq":{seq},"pad":"{}"}}"#,
        "x".repeat(pad)
    )
}

/// `n` publish commands with ids 0 to `n - 1`, each of `message(stream, seq, pad)`, as one
/// NDJSON text.
pub fn publish_burst(stream: &str, n: u64, pad: usize) -> String {
    (0..n)
        .map(|seq| {
            format!(
                "{{\"type\":\"publish\",\"id\":{seq},\"message\":{}}}\n",
                message(stream, seq, pad)
            )
        })
        .collect()
}

/// Publishes `message(stream, seq, pad)` in-process through the engine's hub.
pub fn publish(engine: &Engine, stream: &str, seq: u64, pad: usize) -> usize {
    let m = powerhub::hub::Message::json(message(stream, seq, pad)).unwrap();
    engine
        .hub()
        .publish(stream, m, powerhub::hub::PublishOptions::default())
        .unwrap()
}

/// Connects `n` clients subscribed to `stream` and starts a reader thread for each that expects
/// the messages with `seq` 0 to `messages - 1` in order, counting each one in `received`
/// (`context` names the case in the failure message). Each thread returns its client.
pub fn in_order_readers(
    addr: SocketAddr,
    stream: &str,
    n: usize,
    messages: u64,
    received: &Arc<AtomicU64>,
    context: &str,
) -> Vec<JoinHandle<Client>> {
    let mut clients: Vec<Client> = (0..n).map(|_| Client::connect(addr)).collect();
    for c in &mut clients {
        c.subscribe(stream);
    }
    clients
        .into_iter()
        .map(|mut c| {
            let received = Arc::clone(received);
            let context = context.to_owned();
            std::thread::spawn(move || {
                for expected in 0..messages {
                    let v = c.msg();
                    assert_eq!(v["seq"], expected, "{context}: {v}");
                    received.fetch_add(1, Ordering::Relaxed);
                }
                c
            })
        })
        .collect()
}

/// An engine with an NDJSON, a frame and a WebSocket listener on free loopback ports.
pub struct Servers {
    pub engine: Engine,
    pub ndjson: SocketAddr,
    pub frame: SocketAddr,
    pub websocket: SocketAddr,
}

/// `base_config(backend)` with the three listeners [`serve`] expects.
pub fn config(backend: BackendChoice) -> Config {
    let mut c = base_config(backend);
    c.listeners = vec![
        ListenerConfig::tcp("ndjson", "127.0.0.1:0"),
        ListenerConfig::tcp("frame", "127.0.0.1:0"),
        ListenerConfig::tcp("websocket", "127.0.0.1:0"),
    ];
    c
}

/// Starts `config` (from [`config`]) with the built-in protocols and the WebSocket plugin.
pub fn serve(config: Config) -> Servers {
    let mut registry = ProtocolRegistry::with_builtins();
    let websocket =
        powerhub_websocket::WebSocketFactory::new(powerhub_websocket::WebSocketConfig::default())
            .unwrap();
    registry.register(Arc::new(websocket)).unwrap();
    let engine = Engine::start(config, &registry).expect("engine starts");
    let addr = |protocol: &str| {
        let l = engine
            .listeners()
            .iter()
            .find(|l| l.protocol == protocol)
            .unwrap_or_else(|| panic!("no {protocol} listener"));
        match &l.addr {
            ListenAddr::Tcp(a) => *a,
            other => panic!("{other}"),
        }
    };
    Servers {
        ndjson: addr("ndjson"),
        frame: addr("frame"),
        websocket: addr("websocket"),
        engine,
    }
}

/// A WebSocket client upgraded on a fresh loopback connection to `addr` (`url` its request),
/// with reads bounded by [`WAIT`]. A signal delivered to the test's thread (the test process
/// runs servers) can interrupt the handshake's blocking read (`EINTR`), which the client
/// library reports as a failed handshake with the connection half-read: the upgrade is then
/// made again on a new connection. Any other failure fails the test.
pub fn ws_connect(url: &str, addr: SocketAddr) -> tungstenite::WebSocket<TcpStream> {
    const TRIES: usize = 5;
    for _ in 0..TRIES {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_read_timeout(Some(WAIT)).expect("read timeout");
        match tungstenite::client(url, stream) {
            Ok((ws, _)) => return ws,
            Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Io(e)))
                if e.kind() == std::io::ErrorKind::Interrupted =>
            {
                continue
            }
            Err(e) => panic!("upgrade: {e:?}"),
        }
    }
    panic!("upgrade: interrupted {TRIES} times in a row");
}

/// Reads one hub frame from `s` and returns its JSON messages, as written.
pub fn frame_messages(s: &mut TcpStream) -> Vec<Vec<u8>> {
    use powerhub::plugin::frame;
    let mut head = [0u8; frame::HEADER_LEN];
    s.read_exact(&mut head).unwrap();
    let header = frame::Header::parse(&head).unwrap();
    let mut whole = head.to_vec();
    whole.resize(header.frame_len(), 0);
    s.read_exact(&mut whole[frame::HEADER_LEN..]).unwrap();
    let decoded = frame::decode(&whole).unwrap();
    decoded
        .json_messages()
        .unwrap()
        .into_iter()
        .map(<[u8]>::to_vec)
        .collect()
}
