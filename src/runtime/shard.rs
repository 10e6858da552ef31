//! A shard: one worker thread that owns its connections, their timers and one IO backend.
//!
//! Nothing on a shard's write path takes a lock. Other threads (the hub's drain thread handing
//! frames to a connection's sink, the acceptor handing over a new socket, the engine asking for a
//! shutdown) reach a shard through its lock-free [`SegQueue`] of [`ShardMsg`]s and a wake-up
//! eventfd. A turn of the shard loop:
//!
//! 1. drains the queue (new connections, deliveries, subscription closes, shutdown phases),
//! 2. prepares one send per connection with queued bytes and none in flight, carrying every
//!    chunk ready for it (one `sendmsg` gather list, at most 1024 chunks),
//! 3. waits in the backend, which first submits everything queued in the turn (under io_uring:
//!    one `io_uring_enter` for every connection's sends),
//! 4. handles completions: received bytes go through the connection's [`StreamProtocol`] and the
//!    push session; sent byte counts advance the write queue (a partial send resumes mid-chunk),
//! 5. runs the coarse timers (handshake and idle deadlines, shutdown deadlines) every
//!    [`TICK`].

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use crossbeam_queue::SegQueue;
use powerhub_plugin::{CloseReason, Completion, Inbound, ProtocolError, ProtocolOutput, SendError, StreamProtocol};

use super::session::{self, Session};
use super::sys::{self, syscall, Backend, Event, Token};
use super::writeq::{WriteQueue, MAX_IOV};
use super::Shared;

/// How often a shard checks its connections' deadlines.
pub(crate) const TICK: Duration = Duration::from_millis(50);
/// How long a closing connection waits for the peer to finish before the socket is closed.
const LINGER: Duration = Duration::from_secs(2);
/// [`LINGER`] during a shutdown.
const SHUTDOWN_LINGER: Duration = Duration::from_millis(100);
/// First receive buffer of a connection; doubles up to [`MAX_READ_BUF`] when a read fills it.
const MIN_READ_BUF: usize = 2048;
const MAX_READ_BUF: usize = 64 << 10;

/// Identifies a connection across threads: its shard slot and the slot's generation, so a
/// message for a closed connection never reaches the slot's next tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ConnKey {
    pub(crate) shard: u32,
    pub(crate) index: u32,
    pub(crate) generation: u32,
}

/// A message to a shard.
#[derive(Debug)]
pub(crate) enum ShardMsg {
    /// A socket accepted for this shard.
    NewConn { fd: OwnedFd, listener: usize, over_limit: bool },
    /// A hub frame for a subscription of a connection. `done` is set when the sink answered
    /// `Pending`: the shard completes it once the connection's unsent bytes fall to the high
    /// water mark (or fails it when the connection closes).
    Deliver { conn: ConnKey, sub: Arc<str>, frame: Bytes, done: Option<Completion> },
    /// The hub closed a subscription (slow consumer under `disconnect`, hub closed).
    SubClosed { conn: ConnKey, sub: Arc<str>, reason: CloseReason },
    /// Stop accepting (acceptor shard only).
    StopAccepting,
    /// Shutdown, phase 1: keep serving; at `deadline` close every connection.
    Drain { deadline: Instant },
    /// Shutdown, phase 2 (the hub is flushed): close each connection once its queue is written,
    /// exit when none is left.
    Finish,
}

/// The shard's eventfd, closed when the last handle goes.
#[derive(Debug)]
pub(crate) struct Waker {
    fd: OwnedFd,
}

impl Waker {
    pub(crate) fn new() -> io::Result<Waker> {
        let fd = sys::new_eventfd()?;
        // SAFETY: `fd` was just created and is owned by nobody else.
        Ok(Waker { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// What other threads hold to reach a shard.
#[derive(Debug)]
pub(crate) struct ShardHandle {
    pub(crate) index: usize,
    queue: SegQueue<ShardMsg>,
    waker: Waker,
    /// Set by the shard before it blocks in the backend; a sender that finds it set wakes the
    /// shard. Dekker-style: the shard stores `true` then (SeqCst fence) re-checks the queue; a
    /// sender pushes then (SeqCst fence) reads the flag. At least one of them sees the other's
    /// write, so a message is never left behind a sleeping shard.
    parked: AtomicBool,
    /// Open connections on this shard (for least-loaded assignment and stats).
    pub(crate) conns: AtomicUsize,
}

impl ShardHandle {
    pub(crate) fn new(index: usize) -> io::Result<ShardHandle> {
        Ok(ShardHandle {
            index,
            queue: SegQueue::new(),
            waker: Waker::new()?,
            parked: AtomicBool::new(false),
            conns: AtomicUsize::new(0),
        })
    }

    /// Queues a message and wakes the shard if it sleeps.
    pub(crate) fn send(&self, msg: ShardMsg) {
        self.queue.push(msg);
        // Pairs with the fence in `Shard::run` (see `parked`).
        fence(Ordering::SeqCst);
        if self.parked.load(Ordering::Relaxed) && self.parked.swap(false, Ordering::Relaxed) {
            sys::wake_eventfd(self.waker.raw());
        }
    }
}

/// Engine-wide counters, updated with `Relaxed` increments (they order nothing).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) open: AtomicUsize,
    pub(crate) accepted: AtomicU64,
    pub(crate) closed: AtomicU64,
    pub(crate) rejected: AtomicU64,
    pub(crate) limit_errors: AtomicU64,
    pub(crate) protocol_errors: AtomicU64,
    pub(crate) bytes_in: AtomicU64,
    pub(crate) bytes_out: AtomicU64,
    pub(crate) frames_out: AtomicU64,
    pub(crate) subscriptions: AtomicUsize,
    pub(crate) send_syscalls: AtomicU64,
    pub(crate) unsent: AtomicUsize,
}

/// Connection state shared with the sinks of its subscriptions (on the hub's thread).
#[derive(Debug)]
pub(crate) struct ConnShared {
    pub(crate) key: ConnKey,
    /// Unsent bytes as of the shard's last update (`Relaxed`: advisory, for back-pressure).
    pub(crate) unsent: AtomicUsize,
    /// Set when the connection is closing; sends then fail.
    pub(crate) closed: AtomicBool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Serving.
    Open,
    /// Writing what is queued, then shutting down the sending side.
    Closing,
    /// Sending side shut down; reading (and discarding) until the peer closes or `LINGER`.
    Lingering(Instant),
    /// Closed: waiting for in-flight operations to complete before the slot is freed.
    Dead,
}

/// One connection, owned by its shard. Boxed in the slot table so that the addresses of
/// `msg` and `iov`, which an in-flight send points to, never move.
pub(crate) struct Conn {
    pub(crate) key: ConnKey,
    fd: OwnedFd,
    pub(crate) listener: usize,
    pub(crate) proto: Box<dyn StreamProtocol>,
    /// `encode_text(x)` is `x\n`: a hub NDJSON frame is already framed for this protocol.
    pub(crate) lines_passthrough: bool,
    /// `encode_binary(x)` is `x`: a hub binary frame is already framed for this protocol.
    pub(crate) binary_passthrough: bool,
    rbuf: Vec<u8>,
    inbuf: BytesMut,
    out: WriteQueue,
    /// Chunks of the send in flight (clones keep them alive until its completion).
    inflight: Vec<Bytes>,
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
    recv_inflight: bool,
    send_inflight: bool,
    /// A writability poll is in flight (after a partial send: the connection is paused).
    poll_inflight: bool,
    /// Bytes offered by the send in flight.
    offered: usize,
    state: State,
    pub(crate) shared: Arc<ConnShared>,
    pub(crate) session: Session,
    waiting: Vec<Completion>,
    accepted_at: Instant,
    last_inbound: Instant,
    /// A fatal error to send once the handshake completes (connection over `max_connections`).
    reject: Option<Bytes>,
    counted: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("key", &self.key).field("state", &self.state).finish_non_exhaustive()
    }
}

impl Conn {
    /// Queues one JSON message framed by the connection's protocol.
    pub(crate) fn send_text(&mut self, json: &[u8]) {
        let mut buf = BytesMut::with_capacity(json.len() + 16);
        self.proto.encode_text(json, &mut buf);
        self.out.push(buf.freeze());
    }

    /// Queues a hub frame for delivery: as is when the protocol's framing is the frame's own,
    /// otherwise re-framed message by message.
    fn push_frame(&mut self, frame: Bytes, binary: bool) {
        if binary {
            if self.binary_passthrough {
                self.out.push(frame);
            } else {
                let mut buf = BytesMut::with_capacity(frame.len() + 16);
                if self.proto.encode_binary(&frame, &mut buf).is_ok() {
                    self.out.push(buf.freeze());
                }
            }
        } else if self.lines_passthrough {
            self.out.push(frame);
        } else {
            let mut buf = BytesMut::with_capacity(frame.len() + 16 * 4);
            for line in frame.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
                self.proto.encode_text(line, &mut buf);
            }
            self.out.push(buf.freeze());
        }
    }

    pub(crate) fn is_open(&self) -> bool {
        self.state == State::Open
    }

    fn sync_unsent(&self, counters: &Counters) {
        let now = self.out.unsent();
        let before = self.shared.unsent.swap(now, Ordering::Relaxed);
        if now >= before {
            counters.unsent.fetch_add(now - before, Ordering::Relaxed);
        } else {
            counters.unsent.fetch_sub(before - now, Ordering::Relaxed);
        }
    }
}

/// Probes the hub-frame passthrough properties of a protocol (see [`Conn::lines_passthrough`]).
fn passthrough(proto: &mut dyn StreamProtocol) -> (bool, bool) {
    let mut buf = BytesMut::new();
    proto.encode_text(b"{}", &mut buf);
    let lines = &buf[..] == b"{}\n";
    buf.clear();
    let binary = proto.encode_binary(b"\x01\x02", &mut buf).is_ok() && &buf[..] == b"\x01\x02";
    (lines, binary)
}

/// The live connection `key` names, if it is still the slot's tenant.
fn conn_in(slots: &mut [Option<Box<Conn>>], key: ConnKey) -> Option<&mut Conn> {
    let c = slots.get_mut(key.index as usize)?.as_deref_mut()?;
    (c.key.generation == key.generation).then_some(c)
}

/// A shard's state, living on its thread.
pub(crate) struct Shard<B: Backend> {
    handle: Arc<ShardHandle>,
    shared: Arc<Shared>,
    backend: B,
    slots: Vec<Option<Box<Conn>>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    /// Connections with bytes to send.
    dirty: Vec<Token>,
    /// Listening sockets (acceptor shard only), by listener index.
    listeners: Vec<Option<OwnedFd>>,
    next_shard: usize,
    drain_deadline: Option<Instant>,
    finishing: bool,
    output: ProtocolOutput,
}

impl<B: Backend> Shard<B> {
    pub(crate) fn new(handle: Arc<ShardHandle>, shared: Arc<Shared>, backend: B, listeners: Vec<Option<OwnedFd>>) -> Self {
        Shard {
            handle,
            shared,
            backend,
            slots: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            dirty: Vec::new(),
            listeners,
            next_shard: 0,
            drain_deadline: None,
            finishing: false,
            output: ProtocolOutput::default(),
        }
    }

    pub(crate) fn waker_fd(handle: &ShardHandle) -> RawFd {
        handle.waker.raw()
    }

    /// Runs the shard until shutdown completes.
    pub(crate) fn run(mut self) {
        for (i, l) in self.listeners.iter().enumerate() {
            if let Some(fd) = l {
                if let Err(e) = self.backend.add_listener(i, fd.as_raw_fd()) {
                    tracing::error!(error = %e, listener = i, "cannot start accepting");
                }
            }
        }
        let mut events = Vec::with_capacity(256);
        let mut next_tick = Instant::now() + TICK;
        loop {
            self.drain_queue();
            self.flush_writes();
            if self.finishing && self.slots.iter().all(Option::is_none) {
                break;
            }
            let now = Instant::now();
            let mut timeout = next_tick.saturating_duration_since(now);
            self.handle.parked.store(true, Ordering::Relaxed);
            // Pairs with the fence in `ShardHandle::send` (see `parked`).
            fence(Ordering::SeqCst);
            if !self.handle.queue.is_empty() {
                timeout = Duration::ZERO;
            }
            if let Err(e) = self.backend.wait(Some(timeout), &mut events) {
                tracing::error!(error = %e, backend = self.backend.name(), "backend wait failed");
                std::thread::sleep(Duration::from_millis(1));
            }
            self.handle.parked.store(false, Ordering::Relaxed);
            for event in events.drain(..) {
                self.handle_event(event);
            }
            let now = Instant::now();
            if now >= next_tick {
                self.tick(now);
                next_tick = now + TICK;
            }
        }
        self.close_listeners();
        tracing::debug!(shard = self.handle.index, "shard stopped");
    }

    fn drain_queue(&mut self) {
        while let Some(msg) = self.handle.queue.pop() {
            match msg {
                ShardMsg::NewConn { fd, listener, over_limit } => self.add_conn(fd, listener, over_limit),
                ShardMsg::Deliver { conn, sub, frame, done } => self.deliver(conn, &sub, frame, done),
                ShardMsg::SubClosed { conn, sub, reason } => {
                    if let Some(c) = conn_in(&mut self.slots, conn) {
                        let token = conn.index;
                        let fatal = session::on_sub_closed(c, &self.shared, &sub, reason);
                        self.mark_dirty(token);
                        if fatal {
                            self.begin_close(token);
                        }
                    }
                }
                ShardMsg::StopAccepting => self.close_listeners(),
                ShardMsg::Drain { deadline } => {
                    self.close_listeners();
                    self.drain_deadline = Some(deadline);
                }
                ShardMsg::Finish => {
                    self.close_listeners();
                    self.finishing = true;
                    let tokens: Vec<Token> = self.live_tokens();
                    for t in tokens {
                        self.begin_close(t);
                    }
                }
            }
        }
    }

    fn live_tokens(&self) -> Vec<Token> {
        self.slots.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| i as Token).collect()
    }

    fn close_listeners(&mut self) {
        for i in 0..self.listeners.len() {
            if let Some(fd) = self.listeners[i].take() {
                self.backend.remove_listener(i, fd.as_raw_fd());
                drop(fd);
            }
        }
    }


    fn mark_dirty(&mut self, token: Token) {
        self.dirty.push(token);
    }

    fn add_conn(&mut self, fd: OwnedFd, listener: usize, over_limit: bool) {
        let spec = &self.shared.listeners[listener];
        let mut proto = spec.factory.new_connection(&spec.protocol_limits);
        let (lines_passthrough, binary_passthrough) = passthrough(proto.as_mut());
        let index = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.generations.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        let key = ConnKey { shard: self.handle.index as u32, index, generation: self.generations[index as usize] };
        if let Err(e) = self.backend.add_conn(index, fd.as_raw_fd()) {
            tracing::warn!(error = %e, "cannot register a connection");
            self.free.push(index);
            if !over_limit {
                self.shared.counters.open.fetch_sub(1, Ordering::Relaxed);
            }
            return;
        }
        let now = Instant::now();
        let reject = over_limit.then(|| {
            Bytes::from(session::error_json(
                None,
                "limit_exceeded",
                &format!("the server is at its limit max_connections = {}", self.shared.config.limits.max_connections),
                Some("max_connections"),
            ))
        });
        let shared = Arc::new(ConnShared { key, unsent: AtomicUsize::new(0), closed: AtomicBool::new(false) });
        let conn = Box::new(Conn {
            key,
            fd,
            listener,
            proto,
            lines_passthrough,
            binary_passthrough,
            rbuf: vec![0; MIN_READ_BUF],
            inbuf: BytesMut::new(),
            out: WriteQueue::default(),
            inflight: Vec::new(),
            iov: Vec::new(),
            // SAFETY: an all-zero `msghdr` is valid (null pointers, zero lengths).
            msg: unsafe { std::mem::zeroed() },
            recv_inflight: false,
            send_inflight: false,
            poll_inflight: false,
            offered: 0,
            state: State::Open,
            shared,
            session: Session::default(),
            waiting: Vec::new(),
            accepted_at: now,
            last_inbound: now,
            reject,
            counted: !over_limit,
        });
        self.slots[index as usize] = Some(conn);
        self.handle.conns.fetch_add(1, Ordering::Relaxed);
        self.after_input(index);
        self.arm_recv(index);
    }

    fn arm_recv(&mut self, token: Token) {
        let Some(c) = self.slots[token as usize].as_deref_mut() else { return };
        if c.recv_inflight || matches!(c.state, State::Dead) {
            return;
        }
        c.recv_inflight = true;
        let (ptr, len, fd) = (c.rbuf.as_mut_ptr(), c.rbuf.len(), c.fd.as_raw_fd());
        // SAFETY: `rbuf` belongs to the boxed connection, which is not freed while
        // `recv_inflight` is set (see `free_if_idle`) and is neither resized nor touched until
        // the `Recv` completion clears the flag.
        unsafe { self.backend.recv(token, fd, ptr, len) };
    }

    fn handle_event(&mut self, event: Event) {
        match event {
            Event::Accept { listener, result } => self.on_accept(listener, result),
            Event::Recv { token, result } => self.on_recv(token, result),
            Event::Send { token, result } => self.on_send(token, result),
            Event::Writable { token } => self.on_writable(token),
        }
    }

    fn on_accept(&mut self, listener: usize, result: io::Result<RawFd>) {
        let fd = match result {
            // SAFETY: the backend hands over a socket the kernel just created for us.
            Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
            Err(e) => {
                tracing::warn!(error = %e, listener, "accept failed");
                return;
            }
        };
        if self.listeners.get(listener).is_none_or(Option::is_none) {
            return;
        }
        let counters = &self.shared.counters;
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        let max = self.shared.config.limits.max_connections;
        if counters.open.load(Ordering::Relaxed) >= max {
            counters.rejected.fetch_add(1, Ordering::Relaxed);
            counters.limit_errors.fetch_add(1, Ordering::Relaxed);
            tracing::info!(limit = "max_connections", max, "connection refused: over the limit");
            self.add_conn(fd, listener, true);
            return;
        }
        counters.open.fetch_add(1, Ordering::Relaxed);
        if matches!(self.shared.listeners[listener].addr, super::config::ListenAddr::Tcp(_)) {
            let one: libc::c_int = 1;
            // SAFETY: `one` is live for the call; setsockopt copies it.
            let _ = syscall!(setsockopt(
                fd.as_raw_fd(),
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                (&one as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t
            ));
        }
        let shards = self.shared.shards();
        let target = self.next_shard % shards.len();
        self.next_shard = self.next_shard.wrapping_add(1);
        if target == self.handle.index {
            self.add_conn(fd, listener, false);
        } else {
            shards[target].send(ShardMsg::NewConn { fd, listener, over_limit: false });
        }
    }

    fn on_recv(&mut self, token: Token, result: io::Result<usize>) {
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        c.recv_inflight = false;
        match (c.state, result) {
            (State::Dead, _) => self.free_if_idle(token),
            (State::Lingering(_), Ok(n)) if n > 0 => self.arm_recv(token),
            (State::Lingering(_), _) => self.abort(token),
            (_, Ok(0)) => {
                // The peer shut down its sending side: write what is queued, then close.
                self.begin_close(token);
            }
            (_, Ok(n)) => {
                self.shared.counters.bytes_in.fetch_add(n as u64, Ordering::Relaxed);
                c.inbuf.extend_from_slice(&c.rbuf[..n]);
                if n == c.rbuf.len() && c.rbuf.len() < MAX_READ_BUF {
                    let len = c.rbuf.len() * 2;
                    c.rbuf.resize(len, 0);
                }
                c.last_inbound = Instant::now();
                self.after_input(token);
                if self.slots[token as usize].as_ref().is_some_and(|c| matches!(c.state, State::Open | State::Closing)) {
                    self.arm_recv(token);
                }
            }
            (_, Err(e)) => {
                tracing::debug!(error = %e, "receive failed");
                self.abort(token);
            }
        }
    }

    /// Decodes what arrived and runs the push session on it.
    fn after_input(&mut self, token: Token) {
        let Some(c) = self.slots[token as usize].as_deref_mut() else { return };
        if c.state != State::Open {
            c.inbuf.clear();
            return;
        }
        self.output.clear();
        let result = c.proto.decode(&mut c.inbuf, &mut self.output);
        if !self.output.urgent.is_empty() {
            let urgent = self.output.urgent.split().freeze();
            c.out.push_urgent(urgent);
        }
        if c.proto.is_ready() {
            if let Some(reject) = c.reject.take() {
                c.send_text(&reject);
                self.mark_dirty(token);
                self.begin_close(token);
                return;
            }
        }
        let mut close = false;
        for event in self.output.events.drain(..) {
            let c = self.slots[token as usize].as_deref_mut().expect("live connection");
            match event {
                Inbound::Text(line) => {
                    if session::on_text(c, &self.shared, line) {
                        close = true;
                        break;
                    }
                }
                Inbound::Binary(_) => {
                    let json = session::error_json(None, "unsupported", "binary messages carry no command here", None);
                    c.send_text(json.as_bytes());
                }
                Inbound::Pong => {}
                Inbound::Close { .. } => {
                    close = true;
                    break;
                }
                _ => {}
            }
        }
        self.output.events.clear();
        if let Err(e) = result {
            self.shared.counters.protocol_errors.fetch_add(1, Ordering::Relaxed);
            if matches!(e, ProtocolError::TooLarge { .. }) {
                self.shared.counters.limit_errors.fetch_add(1, Ordering::Relaxed);
            }
            tracing::debug!(error = %e, "protocol error; closing");
            close = true;
        }
        self.mark_dirty(token);
        if close {
            self.begin_close(token);
        }
    }

    fn deliver(&mut self, key: ConnKey, sub: &str, frame: Bytes, done: Option<Completion>) {
        let high_water = self.shared.config.limits.backpressure_bytes;
        let Some(c) = conn_in(&mut self.slots, key) else {
            if let Some(done) = done {
                done.complete(Err(SendError::Closed));
            }
            return;
        };
        if c.state != State::Open {
            if let Some(done) = done {
                done.complete(Err(SendError::Closed));
            }
            return;
        }
        let binary = session::sub_is_binary(c, sub);
        c.push_frame(frame, binary);
        self.shared.counters.frames_out.fetch_add(1, Ordering::Relaxed);
        if let Some(done) = done {
            if c.out.unsent() <= high_water {
                done.complete(Ok(()));
            } else {
                c.waiting.push(done);
            }
        }
        c.sync_unsent(&self.shared.counters);
        self.mark_dirty(key.index);
    }

    /// Starts one send per dirty connection that has bytes queued and none in flight.
    fn flush_writes(&mut self) {
        let max_outbox = self.shared.config.limits.max_outbox_bytes;
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for &token in &dirty {
            let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { continue };
            if c.out.unsent() > max_outbox && c.state == State::Open {
                self.shared.counters.limit_errors.fetch_add(1, Ordering::Relaxed);
                tracing::info!(limit = "max_outbox_bytes", unsent = c.out.unsent(), "closing a connection over its outbox limit");
                let json = session::error_json(
                    None,
                    "limit_exceeded",
                    &format!("unsent bytes exceed max_outbox_bytes = {max_outbox}"),
                    Some("max_outbox_bytes"),
                );
                c.send_text(json.as_bytes());
                self.begin_close(token);
                continue;
            }
            self.start_send(token);
        }
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    fn start_send(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        if c.send_inflight || c.poll_inflight || c.out.is_empty() || matches!(c.state, State::Dead | State::Lingering(_)) {
            if c.state == State::Closing && !c.send_inflight && !c.poll_inflight && c.out.is_empty() {
                self.finish_close(token);
            }
            return;
        }
        c.offered = c.out.prepare(&mut c.inflight);
        c.iov.clear();
        for chunk in c.inflight.iter().take(MAX_IOV) {
            c.iov.push(libc::iovec { iov_base: chunk.as_ptr() as *mut libc::c_void, iov_len: chunk.len() });
        }
        c.msg.msg_iov = c.iov.as_mut_ptr();
        c.msg.msg_iovlen = c.iov.len() as _;
        c.send_inflight = true;
        self.shared.counters.send_syscalls.fetch_add(1, Ordering::Relaxed);
        let (fd, msg) = (c.fd.as_raw_fd(), &c.msg as *const libc::msghdr);
        // SAFETY: `msg`, `iov` and the chunks in `inflight` live in the boxed connection, which
        // is not freed while `send_inflight` is set (see `free_if_idle`), and none of them is
        // touched until the `Send` completion clears the flag. The chunks are `Bytes` clones:
        // their memory stays put even if the write queue drops its own references.
        unsafe { self.backend.send(token, fd, msg) };
    }

    fn on_send(&mut self, token: Token, result: io::Result<usize>) {
        let high_water = self.shared.config.limits.backpressure_bytes;
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        c.send_inflight = false;
        c.inflight.clear();
        if c.state == State::Dead {
            self.free_if_idle(token);
            return;
        }
        match result {
            Ok(n) => {
                self.shared.counters.bytes_out.fetch_add(n as u64, Ordering::Relaxed);
                c.out.advance(n);
                c.sync_unsent(&self.shared.counters);
                if c.out.unsent() <= high_water {
                    for done in c.waiting.drain(..) {
                        done.complete(Ok(()));
                    }
                }
                if n < c.offered {
                    // The socket did not take everything: paused until it drains.
                    c.poll_inflight = true;
                    let fd = c.fd.as_raw_fd();
                    self.backend.poll_writable(token, fd);
                } else {
                    self.mark_dirty(token);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted => {
                self.mark_dirty(token);
            }
            Err(e) => {
                tracing::debug!(error = %e, "send failed");
                self.abort(token);
            }
        }
    }

    fn on_writable(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        c.poll_inflight = false;
        if c.state == State::Dead {
            self.free_if_idle(token);
            return;
        }
        self.mark_dirty(token);
    }

    /// Graceful close: stop reading commands, write what is queued, then shut down.
    pub(crate) fn begin_close(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        if c.state != State::Open {
            return;
        }
        c.state = State::Closing;
        self.release_session(token);
        self.mark_dirty(token);
    }

    /// The queue is written: shut the sending side down and linger for the peer's close.
    fn finish_close(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        // SAFETY: plain syscall on the connection's socket.
        let _ = syscall!(shutdown(c.fd.as_raw_fd(), libc::SHUT_WR));
        // While shutting down, a peer that keeps its side open is not waited for long.
        let linger = if self.finishing { SHUTDOWN_LINGER } else { LINGER };
        c.state = State::Lingering(Instant::now() + linger);
        self.arm_recv(token);
    }

    /// Unsubscribes the connection's hub subscriptions and fails its pending sends.
    fn release_session(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        c.shared.closed.store(true, Ordering::Relaxed);
        session::release(c, &self.shared);
        for done in c.waiting.drain(..) {
            done.complete(Err(SendError::Closed));
        }
    }

    /// Closes at once: no more writes.
    fn abort(&mut self, token: Token) {
        self.release_session(token);
        let Some(c) = self.slots.get_mut(token as usize).and_then(Option::as_deref_mut) else { return };
        if c.state == State::Dead {
            return;
        }
        c.state = State::Dead;
        if c.recv_inflight || c.send_inflight || c.poll_inflight {
            // Makes the in-flight operations complete; the slot is freed after the last one.
            // SAFETY: plain syscall on the connection's socket.
            let _ = syscall!(shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR));
        }
        self.free_if_idle(token);
    }

    /// Frees a dead connection's slot once no operation on it is in flight.
    fn free_if_idle(&mut self, token: Token) {
        let idx = token as usize;
        let Some(c) = self.slots[idx].as_deref() else { return };
        if c.state != State::Dead || c.recv_inflight || c.send_inflight || c.poll_inflight {
            return;
        }
        let c = self.slots[idx].take().expect("checked above");
        self.backend.remove_conn(token, c.fd.as_raw_fd());
        self.generations[idx] = self.generations[idx].wrapping_add(1);
        self.free.push(token);
        self.handle.conns.fetch_sub(1, Ordering::Relaxed);
        let counters = &self.shared.counters;
        counters.unsent.fetch_sub(c.shared.unsent.swap(0, Ordering::Relaxed), Ordering::Relaxed);
        counters.closed.fetch_add(1, Ordering::Relaxed);
        if c.counted {
            counters.open.fetch_sub(1, Ordering::Relaxed);
        }
        drop(c); // closes the socket
    }

    fn tick(&mut self, now: Instant) {
        let limits = &self.shared.config.limits;
        let (handshake, idle) = (limits.handshake_timeout(), limits.idle_timeout());
        let mut to_close = Vec::new();
        let mut to_abort = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            let Some(c) = slot.as_deref_mut() else { continue };
            match c.state {
                State::Lingering(deadline) if now >= deadline => to_abort.push(i as Token),
                State::Closing if self.drain_deadline.is_some_and(|d| now >= d) => to_abort.push(i as Token),
                State::Open => {
                    if self.drain_deadline.is_some_and(|d| now >= d) {
                        to_abort.push(i as Token);
                    } else if !c.proto.is_ready() && now.duration_since(c.accepted_at) >= handshake {
                        self.shared.counters.limit_errors.fetch_add(1, Ordering::Relaxed);
                        to_abort.push(i as Token);
                    } else if idle.is_some_and(|idle| now.duration_since(c.last_inbound) >= idle) {
                        self.shared.counters.limit_errors.fetch_add(1, Ordering::Relaxed);
                        let json = session::error_json(
                            None,
                            "limit_exceeded",
                            &format!("no input for idle_timeout_ms = {}", limits.idle_timeout_ms),
                            Some("idle_timeout_ms"),
                        );
                        c.send_text(json.as_bytes());
                        to_close.push(i as Token);
                    }
                }
                _ => {}
            }
        }
        for t in to_close {
            self.begin_close(t);
        }
        for t in to_abort {
            self.abort(t);
        }
    }
}
