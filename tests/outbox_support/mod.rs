//! A virtual client for outbox tests: a socket that takes as many bytes as it is told to, a
//! virtual clock, and the exact bytes the client has read.
#![allow(dead_code, unreachable_pub)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use powerhub::outbox::{Framing, MessageFactory, Outbox, OutboxConfig, PayloadFactory, PushEvent};
use powerhub::plugin::{ProtocolError, ProtocolOutput, StreamProtocol};

pub use powerhub_ndjson::NdjsonProtocol;

/// NDJSON framing: the `ndjson` plugin's framer, as the server uses it.
pub fn ndjson() -> NdjsonProtocol {
    NdjsonProtocol::new(1 << 20)
}

/// A framing that shows every message went through `encode_text`: `<json>|`, and a protocol
/// ping `PING|`.
#[derive(Debug, Default)]
pub struct Marked;

impl StreamProtocol for Marked {
    fn decode(&mut self, _: &mut BytesMut, _: &mut ProtocolOutput) -> Result<(), ProtocolError> {
        Ok(())
    }
    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        out.extend_from_slice(b"<");
        out.extend_from_slice(json);
        out.extend_from_slice(b">|");
    }
    fn encode_ping(&mut self, out: &mut BytesMut) -> bool {
        out.extend_from_slice(b"PING|");
        true
    }
    fn name(&self) -> &str {
        "marked"
    }
}

/// A factory that counts its calls and adds the subscription and a per-call sequence number:
/// `{"sub":"s","call":N,"payload":<payload>}`.
#[derive(Debug, Default)]
pub struct Counting {
    pub calls: AtomicUsize,
}

impl MessageFactory for Counting {
    fn create_push_message(&self, sub: &str, event: &PushEvent, _now: Instant) -> Bytes {
        let n = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let payload = std::str::from_utf8(event.payload()).unwrap();
        format!(r#"{{"sub":"{sub}","call":{n},"payload":{payload}}}"#).into()
    }
}

pub fn ndjson_config() -> OutboxConfig {
    OutboxConfig {
        framing: Framing::Ndjson,
        ..OutboxConfig::default()
    }
}

/// A connection: an outbox, its framer, the client's received bytes and a virtual clock.
pub struct Conn<P: StreamProtocol = NdjsonProtocol> {
    pub outbox: Outbox,
    pub framer: P,
    pub read: Vec<u8>,
    pub t0: Instant,
    pub now: Instant,
    pub offered_log: Vec<usize>,
}

impl Conn<NdjsonProtocol> {
    pub fn new(config: OutboxConfig) -> Self {
        Conn::with(config, Arc::new(PayloadFactory), ndjson())
    }
}

impl<P: StreamProtocol> Conn<P> {
    pub fn with(config: OutboxConfig, factory: Arc<dyn MessageFactory>, framer: P) -> Self {
        let t0 = Instant::now();
        Conn {
            outbox: Outbox::new(config, factory, t0).unwrap(),
            framer,
            read: Vec::new(),
            t0,
            now: t0,
            offered_log: Vec::new(),
        }
    }

    pub fn advance(&mut self, d: Duration) {
        self.now += d;
    }

    pub fn at(&self, secs: f64) -> Instant {
        self.t0 + Duration::from_secs_f64(secs)
    }

    /// One transmit where the socket takes at most `cap` bytes; returns (offered, taken).
    pub fn write(&mut self, cap: usize) -> (usize, usize) {
        let mut out = Vec::new();
        let offered = self
            .outbox
            .poll_transmit(&mut self.framer, &mut out, self.now);
        assert_eq!(
            offered,
            out.iter().map(Bytes::len).sum::<usize>(),
            "offered = bytes in out"
        );
        self.offered_log.push(offered);
        let mut left = cap.min(offered);
        let taken = left;
        for b in &out {
            let n = left.min(b.len());
            self.read.extend_from_slice(&b[..n]);
            left -= n;
            if left == 0 {
                break;
            }
        }
        if offered > 0 {
            self.outbox.on_written(taken, self.now);
        }
        (offered, taken)
    }

    /// Writes until there is nothing left, the socket taking everything.
    pub fn flush(&mut self) {
        for _ in 0..1000 {
            if !self.outbox.has_transmit() {
                return;
            }
            self.write(usize::MAX);
        }
        panic!("flush did not finish");
    }

    /// The drain event, then a write of everything.
    pub fn drain(&mut self) {
        self.outbox.on_writable(self.now);
        self.flush();
    }

    pub fn read_str(&self) -> &str {
        std::str::from_utf8(&self.read).unwrap()
    }

    pub fn lines(&self) -> Vec<String> {
        self.read_str().lines().map(str::to_owned).collect()
    }

    /// Takes the read bytes.
    pub fn take(&mut self) -> String {
        String::from_utf8(std::mem::take(&mut self.read)).unwrap()
    }

    pub fn shared(&mut self, sub: &str, lines: &str) {
        let now = self.now;
        self.outbox
            .push_shared(sub, Bytes::copy_from_slice(lines.as_bytes()), now);
    }

    pub fn event(&mut self, sub: &str, json: &str) {
        let now = self.now;
        self.outbox.push_event(
            sub,
            PushEvent::from_json(Bytes::copy_from_slice(json.as_bytes())),
            now,
        );
    }

    pub fn control(&mut self, json: &str) {
        let now = self.now;
        self.outbox
            .push_control(Bytes::copy_from_slice(json.as_bytes()), now);
    }

    /// Stalls the connection: pushes `json` (as a control) and lets the socket take `taken` bytes
    /// of it.
    pub fn stall_with(&mut self, json: &str, taken: usize) {
        self.control(json);
        let (offered, got) = self.write(taken);
        assert!(got < offered, "the stall write must be partial");
        assert!(self.outbox.is_paused());
    }
}

/// A screenshot message: `{"type":"screenshot_update",<device/session fields>,"captureSequence":N,"png":"<pad>"}`.
pub fn shot(device: Option<&str>, session: Session, seq: u64, pad: usize) -> String {
    state("screenshot_update", device, session, seq, pad)
}

/// A hierarchy message, same shape as [`shot`].
pub fn tree(device: Option<&str>, session: Session, seq: u64) -> String {
    state("hierarchy_update", device, session, seq, 0)
}

#[derive(Clone, Copy, Debug)]
pub enum Session<'a> {
    Absent,
    Null,
    Str(&'a str),
}

pub fn state(kind: &str, device: Option<&str>, session: Session, seq: u64, pad: usize) -> String {
    let mut s = format!(r#"{{"type":"{kind}""#);
    if let Some(d) = device {
        s.push_str(&format!(r#","deviceId":"{d}""#));
    }
    match session {
        Session::Absent => {}
        Session::Null => s.push_str(r#","deviceSessionUuid":null"#),
        Session::Str(u) => s.push_str(&format!(r#","deviceSessionUuid":"{u}""#)),
    }
    s.push_str(&format!(r#","captureSequence":{seq}"#));
    if pad > 0 {
        s.push_str(&format!(r#","png":"{}""#, "A".repeat(pad)));
    }
    s.push('}');
    s
}
