//! Shared by the codec's tests: client frames, handshakes, and reading server frames.
#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

use powerhub_plugin::{
    BytesMut, Inbound, ProtocolError, ProtocolFactory, ProtocolLimits, ProtocolOutput,
    StreamProtocol,
};
use powerhub_websocket::{WebSocketConfig, WebSocketFactory};

pub const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
pub const ACCEPT: &str = "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=";

/// A valid upgrade request for `path` with extra header lines.
pub fn request(path: &str, extra: &str) -> String {
    format!(
        "GET {path} HTTP/1.1\r\nHost: localhost:8080\r\nUpgrade: websocket\r\n\
         Connection: Upgrade\r\nSec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    )
}

/// A masked client frame.
pub fn frame(fin: bool, opcode: u8, payload: &[u8], key: [u8; 4]) -> Vec<u8> {
    let mut out = vec![(u8::from(fin) << 7) | opcode];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n if n <= 0xffff => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        n => {
            out.push(0x80 | 127);
            out.extend_from_slice(&(n as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    out
}

/// A final masked client frame with a fixed key.
pub fn data(opcode: u8, payload: &[u8]) -> Vec<u8> {
    frame(true, opcode, payload, [0x37, 0xfa, 0x21, 0x3d])
}

/// A close frame payload: code then reason.
pub fn close_payload(code: u16, reason: &str) -> Vec<u8> {
    let mut p = code.to_be_bytes().to_vec();
    p.extend_from_slice(reason.as_bytes());
    p
}

/// What one `decode` call produced.
#[derive(Debug)]
pub struct Step {
    pub result: Result<(), ProtocolError>,
    pub events: Vec<Inbound>,
    pub urgent: Vec<u8>,
    pub left: usize,
}

pub fn factory(config: WebSocketConfig) -> WebSocketFactory {
    WebSocketFactory::new(config).expect("valid config")
}

pub fn connection(config: WebSocketConfig) -> Box<dyn StreamProtocol> {
    factory(config).new_connection(&ProtocolLimits::default())
}

/// Feeds `bytes` in one call.
pub fn feed(conn: &mut dyn StreamProtocol, bytes: &[u8]) -> Step {
    let mut input = BytesMut::from(bytes);
    let mut out = ProtocolOutput::default();
    let result = conn.decode(&mut input, &mut out);
    Step {
        result,
        events: out.events,
        urgent: out.urgent.to_vec(),
        left: input.len(),
    }
}

/// A connection past its handshake.
pub fn upgraded(config: WebSocketConfig) -> Box<dyn StreamProtocol> {
    let mut conn = connection(config);
    let step = feed(conn.as_mut(), request("/", "").as_bytes());
    assert_eq!(step.result, Ok(()));
    assert!(
        step.urgent.starts_with(b"HTTP/1.1 101 "),
        "{}",
        String::from_utf8_lossy(&step.urgent)
    );
    conn
}

/// An upgraded connection with default config fed `bytes`.
pub fn after_upgrade(bytes: &[u8]) -> Step {
    let mut conn = upgraded(WebSocketConfig::default());
    feed(conn.as_mut(), bytes)
}

/// One server frame: (fin, opcode, payload); asserts it is unmasked.
pub fn server_frames(mut wire: &[u8]) -> Vec<(bool, u8, Vec<u8>)> {
    let mut frames = Vec::new();
    while !wire.is_empty() {
        assert!(wire.len() >= 2, "truncated server frame");
        let fin = wire[0] & 0x80 != 0;
        let opcode = wire[0] & 0x0f;
        assert_eq!(wire[1] & 0x80, 0, "server frames are unmasked");
        let (len, header) = match wire[1] & 0x7f {
            126 => (u16::from_be_bytes([wire[2], wire[3]]) as usize, 4),
            127 => (
                u64::from_be_bytes(wire[2..10].try_into().unwrap()) as usize,
                10,
            ),
            n => (n as usize, 2),
        };
        frames.push((fin, opcode, wire[header..header + len].to_vec()));
        wire = &wire[header + len..];
    }
    frames
}

/// The close code and reason of the close frame in `urgent`: the only frame, or, for a close
/// over a limit (1009), the one after the push protocol's error naming the limit.
pub fn close_of(urgent: &[u8]) -> (u16, String) {
    let mut frames = server_frames(urgent);
    if frames.len() == 2 {
        let (_, opcode, error) = frames.remove(0);
        assert_eq!(opcode, 0x1, "the error before the close is a text message");
        let error = String::from_utf8(error).expect("UTF-8 error");
        assert!(
            error.starts_with(r#"{"type":"error","requestId":null,"code":"limit_exceeded","#)
                && error.contains(r#""limit":"max_"#),
            "{error}"
        );
        let (_, _, close) = &frames[0];
        assert_eq!(
            u16::from_be_bytes([close[0], close[1]]),
            1009,
            "only a close over a limit follows an error"
        );
    }
    assert_eq!(frames.len(), 1, "expected one close frame, got {frames:?}");
    let (_, opcode, payload) = &frames[0];
    assert_eq!(*opcode, 0x8, "expected a close frame");
    if payload.is_empty() {
        return (1005, String::new());
    }
    let code = u16::from_be_bytes([payload[0], payload[1]]);
    (
        code,
        String::from_utf8(payload[2..].to_vec()).expect("UTF-8 reason"),
    )
}

/// Asserts that `step` failed with a close frame carrying `code`; returns the reason.
pub fn assert_closed_with(step: &Step, code: u16) -> String {
    assert!(step.result.is_err(), "expected an error, got {step:?}");
    let (got, reason) = close_of(&step.urgent);
    assert_eq!(
        got, code,
        "close code (reason {reason:?}, error {:?})",
        step.result
    );
    reason
}

/// The HTTP status code of a response in `urgent`.
pub fn status_of(urgent: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(urgent);
    let line = text.lines().next().unwrap_or_default();
    line.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// What the echo loop saw on one connection.
#[derive(Debug)]
pub struct ServerLog {
    pub events: Vec<Inbound>,
    pub error: Option<ProtocolError>,
}

/// A loopback TCP server driving one codec per connection with a small echo loop, standing in
/// for the runtime's shard: it echoes text and binary messages; `ping-me` makes it send a ping
/// and report the pong as the text `got pong`; `close-me` makes it close with 1001. Stops
/// accepting when dropped.
pub struct EchoServer {
    pub port: u16,
    logs: mpsc::Receiver<ServerLog>,
    stop: Arc<AtomicBool>,
}

const IO_TIMEOUT: Duration = Duration::from_secs(10);

impl EchoServer {
    /// Listens on 127.0.0.1; each connection reads at most `read_chunk` bytes at a time.
    pub fn start(config: WebSocketConfig, read_chunk: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let factory = WebSocketFactory::new(config).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, logs) = mpsc::channel();
        let accept_stop = Arc::clone(&stop);
        thread::spawn(move || {
            while !accept_stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((sock, _)) => {
                        let (factory, tx) = (factory.clone(), tx.clone());
                        thread::spawn(move || {
                            let _ = tx.send(echo(sock, &factory, read_chunk));
                        });
                    }
                    Err(_) => thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        EchoServer { port, logs, stop }
    }

    /// The log of the next connection to finish.
    pub fn next_log(&self) -> ServerLog {
        self.logs
            .recv_timeout(Duration::from_secs(30))
            .expect("a connection finished")
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn echo(mut sock: TcpStream, factory: &WebSocketFactory, read_chunk: usize) -> ServerLog {
    sock.set_nonblocking(false).unwrap();
    sock.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    sock.set_nodelay(true).unwrap();
    let mut conn = factory.connection(&ProtocolLimits::default());
    let mut input = BytesMut::new();
    let mut out = ProtocolOutput::default();
    let mut buf = vec![0u8; read_chunk];
    let mut log = ServerLog {
        events: Vec::new(),
        error: None,
    };
    loop {
        let n = match sock.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        input.extend_from_slice(&buf[..n]);
        let result = conn.decode(&mut input, &mut out);
        let mut data = BytesMut::new();
        let mut closed = false;
        for event in out.events.drain(..) {
            match &event {
                Inbound::Text(t) if &t[..] == b"ping-me" => assert!(conn.encode_ping(&mut data)),
                Inbound::Text(t) if &t[..] == b"close-me" => {
                    conn.encode_close(1001, "bye", &mut data)
                }
                Inbound::Text(t) => conn.encode_text(t, &mut data),
                Inbound::Binary(b) => conn.encode_binary(b, &mut data).unwrap(),
                Inbound::Pong => conn.encode_text(b"got pong", &mut data),
                Inbound::Close { .. } => closed = true,
                other => panic!("unexpected event {other:?}"),
            }
            log.events.push(event);
        }
        // Urgent bytes first: control never queues behind data.
        let _ = sock.write_all(&out.urgent);
        let _ = sock.write_all(&data);
        out.clear();
        if let Err(error) = result {
            log.error = Some(error);
            break;
        }
        if closed {
            break;
        }
    }
    let _ = sock.shutdown(Shutdown::Write);
    // Drain until the client closes (bounded), so that it reads our last bytes rather than a
    // reset.
    let _ = sock.set_read_timeout(Some(Duration::from_secs(2)));
    let _ = std::io::copy(&mut sock, &mut std::io::sink());
    log
}
