//! A shard: one worker thread that owns its connections, their subscriptions, their timers and
//! one IO backend.
//!
//! Nothing on a shard's write path takes a lock. Other threads reach a shard through lock-free
//! queues and a wake-up eventfd: a shard that accepted another's connection hands it over, and
//! the engine its shutdown phases, as [`ShardMsg`]s; publishers queue the entries for the
//! shard's subscriptions in its inbox (see [`super::fanout`]). A turn of the shard loop:
//!
//! 1. fans out its inbox (unless the turn gap holds it back), in the order publications
//!    reached it: each run of one topic's publications in batches, each batch encoded once per
//!    wire format (shared with other shards that cut the same batch), the same `Bytes` into
//!    every local subscriber's [`Outbox`],
//! 2. drains the message queue (new connections, shutdown phases),
//! 3. starts one send per connection that has bytes to write and none in flight, carrying
//!    everything ready for it: the protocol's urgent bytes and what the connection's
//!    [`Outbox`] offers (one `sendmsg` gather list, at most 1024 chunks; a shared frame is a
//!    chunk by reference, never copied, on NDJSON and frame-protocol connections),
//! 4. waits in the backend, which first submits everything queued in the turn (under io_uring:
//!    one `io_uring_enter` for every connection's sends),
//! 5. handles completions: received bytes go through the connection's [`StreamProtocol`] and
//!    the push session; a send's byte count goes to the outbox (`on_written`), and a partial
//!    send pauses the connection until a writability poll reports the drain (`on_writable`),
//! 6. runs the coarse timers every [`TICK`]: handshake and idle deadlines, the outbox's
//!    keepalive and liveness, closing and shutdown deadlines.
//!
//! A connection lives in a boxed slot; it is freed only when no receive, send or poll on it is
//! in flight (the backend contract's buffer rule), and its slot's generation changes, so a
//! subscription left in a topic's list never reaches the slot's next tenant.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use crossbeam_queue::SegQueue;
use powerhub_plugin::codes;

use super::config::SMALL_SEND_BYTES;
use super::fanout::{DirtyFlag, Fanout, LocalSub, LocalTopic, Publications, Tapped};
use super::parker::Parker;
use super::sys::{self, syscall, Backend, Event, Token};
use super::tls::TlsLayer;
use super::Shared;
use crate::hub::{Entry, Hub, Message, PublishError, PublishOptions, SealedBatch};
use crate::protocol::Session;
use crate::push::{Ending, PushConnection, PushState, Request, Transmit, MAX_IOV};

/// How often a shard checks its connections' deadlines.
pub(crate) const TICK: Duration = Duration::from_millis(50);

/// Output memory freed by closed connections past which a tick returns free memory to the
/// system.
const RELEASE_AFTER_FREED: usize = 1 << 20;
/// The messages a [`PublishRun`] keeps room for between inputs: a receive buffer's worth of
/// the shortest publish lines (about 56 bytes), so that a pipelining publisher's run is not
/// grown again, a reallocation at a time, for every receive (1 024 did that for 64-byte
/// messages: about 58 instructions per publish).
const KEEP_RUN: usize = 4096;
/// Bytes from which a receive's buffer becomes the connection's input as it is (no copy). A
/// smaller receive is copied into a buffer of its own size: the messages decoded from a buffer
/// keep all of it alive (a retained one too), so a small receive should not hold a whole
/// receive buffer.
const TAKE_RECV_MIN: usize = sys::RECV_BUF_LEN / 2;
/// `TCP_NOTSENT_LOWAT` of every TCP connection: the unsent bytes the kernel holds at most (see
/// `Shard::on_accept`).
const SEND_LOWAT: usize = 256 << 10;
/// How long a closing connection waits for the peer to finish before the socket is closed.
const LINGER: Duration = Duration::from_secs(2);
/// How long a closing connection may take to write what it holds before it is closed anyway.
const CLOSE_FLUSH: Duration = Duration::from_secs(5);
/// [`LINGER`] during a shutdown.
const SHUTDOWN_LINGER: Duration = Duration::from_millis(100);
/// While a shutdown drains, a connection that sent nothing for this long has nothing left to
/// read (what it sent before the shutdown arrived long before: a receive completes within
/// microseconds of the bytes' arrival on loopback, and well within this on any network).
const DRAIN_QUIET: Duration = Duration::from_millis(100);

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
    NewConn {
        fd: OwnedFd,
        listener: usize,
        over_limit: bool,
    },
    /// Shutdown, phase 1: stop accepting, keep reading and serving; set
    /// [`ShardHandle::is_quiet`] once no connection has sent anything for [`DRAIN_QUIET`] and
    /// none has input held back by its output; at `deadline` close every connection.
    Drain { deadline: Instant },
    /// Shutdown, phase 2: read no more input (what arrives is discarded), then set
    /// [`ShardHandle::has_stopped_reading`]. Every shard stops before any finishes, so each
    /// connection is sent everything any shard published before it closes.
    StopReading,
    /// Shutdown, phase 3 (every shard stopped reading, the hub is flushed): close each
    /// connection once its queue is written, exit when none is left.
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
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Waker { fd })
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
    /// The sleep/wake handshake with senders (see [`Parker`]).
    parker: Parker,
    /// Open connections on this shard (for least-loaded assignment and stats).
    pub(crate) conns: AtomicUsize,
    /// Set while a shutdown drains, once every connection has gone quiet (see
    /// [`ShardMsg::Drain`]).
    quiet: AtomicBool,
    /// Set once the shard read its last input of a shutdown (see [`ShardMsg::StopReading`]).
    stopped_reading: AtomicBool,
    /// Publications for the shard's topics, in the order they reached it, and whether it is
    /// listed (see [`super::fanout`]).
    inbox: SegQueue<Tapped>,
    listed: DirtyFlag,
}

impl ShardHandle {
    pub(crate) fn new(index: usize) -> io::Result<ShardHandle> {
        Ok(ShardHandle {
            index,
            queue: SegQueue::new(),
            waker: Waker::new()?,
            parker: Parker::default(),
            conns: AtomicUsize::new(0),
            quiet: AtomicBool::new(false),
            stopped_reading: AtomicBool::new(false),
            inbox: SegQueue::new(),
            listed: DirtyFlag::default(),
        })
    }

    /// Whether the shard, draining for a shutdown, has read everything its connections sent.
    pub(crate) fn is_quiet(&self) -> bool {
        // Acquire pairs with the shard's Release store: what it published before going quiet
        // (its publishes into the hub) is visible to the caller, which flushes the hub next.
        self.quiet.load(Ordering::Acquire)
    }

    /// Whether the shard, in a shutdown, reads no more input.
    pub(crate) fn has_stopped_reading(&self) -> bool {
        // Acquire pairs with the shard's Release store: its publishes into the hub are visible
        // (and in the other shards' inboxes) by then.
        self.stopped_reading.load(Ordering::Acquire)
    }

    /// Queues a message and wakes the shard if it sleeps.
    pub(crate) fn send(&self, msg: ShardMsg) {
        self.queue.push(msg);
        self.wake();
    }

    /// Queues a publication for one of the shard's topics; wakes the shard when its inbox was
    /// not listed (see [`super::fanout`]).
    pub(crate) fn tap(&self, tapped: Tapped) {
        self.inbox.push(tapped);
        if self.listed.mark() {
            self.wake();
        }
    }

    /// Wakes the shard if it sleeps, after the caller made work visible to it (a queue push, or
    /// the hub's `work` flag, which the shard reads after `park_begin`).
    pub(crate) fn wake(&self) {
        if self.parker.should_wake() {
            sys::wake_eventfd(self.waker.raw());
        }
    }
}

/// One shard's counters, updated with `Relaxed` increments (they order nothing) by that shard
/// only and summed when read ([`Shared::counters`]); each shard's set is cache-padded, so no two
/// shards write one cache line. (The count of open connections, which admission reads, is
/// engine-wide: [`Shared::open`].)
#[derive(Debug, Default)]
pub(crate) struct Counters {
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Serving.
    Open,
    /// Writing what is queued, then shutting down the sending side; closed regardless at the
    /// deadline (in milliseconds since the shard's epoch, as every connection timestamp).
    Closing(u64),
    /// Sending side shut down; reading (and discarding) until the peer closes or `LINGER`
    /// (the deadline in milliseconds since the shard's epoch).
    Lingering(u64),
    /// Closed: waiting for in-flight operations to complete before the slot is freed.
    Dead,
}

/// The gather list of a send in flight and its layout. A connection holds one only while a send
/// is in flight (an idle connection holds none); the shard keeps a few spare ones for reuse.
/// Boxed, so that the addresses of `msg` and `iov`, which the kernel reads until the send's
/// completion, never move.
struct SendState {
    /// Chunks of the send (clones keep them alive until its completion).
    chunks: Vec<Bytes>,
    iov: Vec<libc::iovec>,
    msg: libc::msghdr,
    /// The push connection's plaintext the send carries (what its `poll_transmit` offered).
    transmit: Option<Transmit>,
    /// Bytes of TLS ciphertext the send carries (then it carries nothing else).
    tls: usize,
}

/// Most spare [`SendState`]s a shard keeps.
const SPARE_SENDS: usize = 64;
/// A spare [`SendState`] whose vectors grew past this many entries is dropped, not kept.
const SPARE_SEND_CAPACITY: usize = 64;

impl SendState {
    fn new() -> Box<SendState> {
        Box::new(SendState {
            chunks: Vec::new(),
            iov: Vec::new(),
            // SAFETY: an all-zero `msghdr` is valid (null pointers, zero lengths).
            msg: unsafe { std::mem::zeroed() },
            transmit: None,
            tls: 0,
        })
    }
}

/// One connection, owned by its shard: the push connection and its socket's state.
pub(crate) struct Conn {
    /// Everything of the connection but its socket (protocol, session, outbox, deadlines).
    pub(crate) push: PushConnection,
    /// TLS, on a listener with `tls_cert`: the record layer between the plaintext above and
    /// the socket (see [`super::tls`]).
    tls: Option<Box<TlsLayer>>,
    /// The connection's slot and generation.
    pub(crate) key: ConnKey,
    /// The backlog last added to the engine's `unsent` counter (see `sync_backlog`); a
    /// connection's share of the counter stops at 4 GiB (a `u32` keeps [`Conn`] in its
    /// allocator size class).
    reported_backlog: u32,
    /// The send in flight (`Some` exactly while one is).
    send: Option<Box<SendState>>,
    /// A send started since the last [`TICK`]: the connection is not idle.
    sent_recently: bool,
    recv_inflight: bool,
    /// A receive returned 0: the peer shut its sending side down, so closing needs neither a
    /// half-close nor a linger (nothing more can arrive).
    peer_eof: bool,
    /// A writability poll is in flight (after a partial send: the connection is paused).
    poll_inflight: bool,
    state: State,
    counted: bool,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("key", &self.key)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// Bytes the connection holds for the peer: the push connection's backlog and TLS's
    /// pending ciphertext.
    fn backlog(&self) -> usize {
        self.push.backlog() + self.tls.as_ref().map_or(0, |t| t.pending.len())
    }

    /// Frees what an idle connection keeps for its next write or read (queue capacities,
    /// framing scratch, an empty input buffer), once no send started for a whole [`TICK`]:
    /// a busy connection keeps them, an idle one costs only its state.
    /// Returns whether the connection was not idle (so was left as it is).
    fn shrink_if_idle(&mut self) -> bool {
        if std::mem::take(&mut self.sent_recently) || self.send.is_some() {
            return true;
        }
        self.push.shrink_idle();
        false
    }

    fn sync_backlog(&mut self, counters: &Counters) -> usize {
        let backlog = self.backlog();
        let now = u32::try_from(backlog).unwrap_or(u32::MAX);
        let before = std::mem::replace(&mut self.reported_backlog, now);
        if now >= before {
            counters
                .unsent
                .fetch_add((now - before) as usize, Ordering::Relaxed);
        } else {
            counters
                .unsent
                .fetch_sub((before - now) as usize, Ordering::Relaxed);
        }
        backlog
    }
}

/// Whether the first bytes of a connection are a TLS handshake record (content type 22,
/// protocol major version 3): no push protocol's first message starts so.
fn looks_like_tls(data: &[u8]) -> bool {
    data.len() >= 3 && data[0] == 0x16 && data[1] == 0x03 && data[2] <= 0x04
}

/// Whether a pass that started `sends` sends of `bytes` bytes in all is followed by the quiet
/// `gap` (`engine.turn_gap_us`): only when they were small on average, the case where each
/// segment costs the server and its readers more than its bytes do, and only while the shard is
/// busy: its [`Load`] says so (`busy`: it lately spent half its time or more on the CPU, and
/// has not fallen far under that since) and the pass began within `gap / 2` of the end of the previous pass that sent (or of the gap
/// that followed it), `idle_before`. A publication that finds the shard idle is sent at once (an
/// unloaded round trip pays no gap), and so is a moderate steady stream that leaves the shard
/// mostly waiting; near saturation the gap gathers what comes next.
fn wants_gap(sends: usize, bytes: usize, gap: Duration, idle_before: Duration, busy: bool) -> bool {
    !gap.is_zero() && sends > 0 && bytes < SMALL_SEND_BYTES * sends && idle_before < gap / 2 && busy
}

/// A shard whose [`Load`] reaches this share of its time on the CPU counts as busy: a half. On
/// loopback here, a shard fanning 15 800 msg/s of 64 B out to 100 connections on a CPU of its
/// own (a quarter of the slowest peer's maximum in the perf tool's latency scenario) spent
/// 0.63–0.68 of its time there with the gap, and each of two shards fanning 5 000 msg/s out to
/// 10 connections 0.23–0.33 without it.
const BUSY_FROM: f32 = 0.5;

/// A busy shard counts as busy until its share falls under this: the gap lowers the share it
/// is chosen by, so it is left only well below where it is taken.
const BUSY_UNTIL: f32 = 0.35;

/// The shortest span [`Load`] measures before it counts it.
const LOAD_WINDOW: Duration = Duration::from_millis(5);

/// How long [`Load`]'s smoothing remembers: a span this long or longer replaces the share.
const LOAD_MEMORY: Duration = Duration::from_millis(20);

/// How busy a shard has been lately: the CPU time its thread used (user and kernel mode, so the
/// sends' system calls count) over the wall time that passed, measured over spans of at least
/// [`LOAD_WINDOW`] (a span ends with the first turn of the loop past it; one read of the
/// thread's CPU clock per span) and smoothed over [`LOAD_MEMORY`] (a span weighs its length
/// over that, at most all). Time spent waiting, in the gap or for events, and time the thread
/// was runnable while another ran, count as idle: a shard is busy for the work it does, not
/// for the machine's, so on a machine short of CPU a shard under moderate load sends at once.
/// It turns busy at [`BUSY_FROM`] and idle under [`BUSY_UNTIL`].
#[derive(Debug)]
struct Load {
    /// When the current span began, and the thread's CPU time then.
    since: Instant,
    cpu_since: Option<Duration>,
    /// The smoothed share, 0 to 1.
    share: f32,
    busy: bool,
}

impl Load {
    fn new(now: Instant, cpu: Option<Duration>) -> Load {
        Load {
            since: now,
            cpu_since: cpu,
            share: 0.0,
            busy: false,
        }
    }

    /// A turn of the shard's loop (a wake-up and its events) ended at `now`; `cpu` reads the
    /// thread's CPU time, once the span is long enough to count (`None` if it cannot: the span
    /// is not counted, and the share stays as it was).
    fn turned(&mut self, now: Instant, cpu: impl FnOnce() -> Option<Duration>) {
        let span = now.saturating_duration_since(self.since);
        if span < LOAD_WINDOW {
            return;
        }
        let cpu = cpu();
        if let (Some(cpu), Some(before)) = (cpu, self.cpu_since) {
            let used = cpu.saturating_sub(before).as_secs_f32() / span.as_secs_f32();
            let weight = (span.as_secs_f32() / LOAD_MEMORY.as_secs_f32()).min(1.0);
            self.share += (used.min(1.0) - self.share) * weight;
            if self.share >= BUSY_FROM {
                self.busy = true;
            } else if self.share < BUSY_UNTIL {
                self.busy = false;
            }
        }
        self.since = now;
        self.cpu_since = cpu;
    }
}

/// `t` in milliseconds since `epoch` (0 before it): a connection's timestamps in 8 bytes.
fn millis(epoch: Instant, t: Instant) -> u64 {
    t.saturating_duration_since(epoch).as_millis() as u64
}

/// Delivers one batch's `lines` to the topic's [`LocalSub::repeated`] subscriptions: for each
/// connection with several subscriptions to the topic, message by message, each message to
/// every one of them in subscription order before the next message (as the connection's FIFO
/// has the publications), where one batch per subscription would put the first subscription's
/// whole batch ahead of the second's copies. Each line is a slice of the shared batch (no
/// copy). Returns the (subscription, batch) deliveries made.
fn deliver_interleaved(
    slots: &mut Slots,
    dirty: &mut Vec<Token>,
    topic: &LocalTopic,
    lines: &Bytes,
    now: Instant,
) -> u64 {
    let mut subs: Vec<&LocalSub> = topic.subs.iter().filter(|s| s.repeated).collect();
    // Grouped by connection (a stable sort: within one, the topic list's order; the copies of
    // one message are the same bytes, whichever goes first).
    subs.sort_by_key(|s| (s.conn.index, s.conn.generation));
    let parts: Vec<Bytes> = crate::outbox::whole_lines(lines).collect();
    let mut deliveries = 0;
    for group in subs.chunk_by(|a, b| a.conn == b.conn) {
        let Some(c) = slots.get_key(group[0].conn) else {
            continue;
        };
        if c.state != State::Open {
            continue;
        }
        for part in &parts {
            for sub in group {
                c.push.deliver_lines(&sub.id, part.clone(), now);
                sub.count_sent(part.len());
            }
        }
        deliveries += group.len() as u64;
        dirty.push(group[0].conn.index);
    }
    deliveries
}

/// Publishes a connection's message to each of its topics; the subscribers it reached, or the
/// last error. The last topic takes the message itself: a clone turns bytes made from a vector
/// into shared ones (an allocation), for a message most often published to one topic.
fn publish<'t>(
    hub: &Hub,
    mut topics: impl ExactSizeIterator<Item = &'t str>,
    message: Message,
) -> Result<usize, PublishError> {
    let add = |total: Result<usize, PublishError>, r| match r {
        Ok(n) => total.map(|t| t + n),
        Err(e) => Err(e),
    };
    // Every topic is published to, even after an error (not `try_fold`).
    let mut total = Ok(0);
    while let Some(topic) = topics.next() {
        if topics.len() == 0 {
            return add(
                total,
                hub.publish(topic, message, PublishOptions::default()),
            );
        }
        total = add(
            total,
            hub.publish(topic, message.clone(), PublishOptions::default()),
        );
    }
    total
}

/// Sets the `IPPROTO_TCP` option `option` of socket `fd` to `value`; a failure leaves the
/// kernel's default (the options tune, they are not needed).
fn set_tcp_option(fd: &OwnedFd, option: libc::c_int, value: libc::c_int) {
    // SAFETY: `value` is live for the call; setsockopt copies it.
    let _ = syscall!(setsockopt(
        fd.as_raw_fd(),
        libc::IPPROTO_TCP,
        option,
        (&value as *const libc::c_int).cast(),
        std::mem::size_of::<libc::c_int>() as libc::socklen_t
    ));
}

/// A connection's publishes without an id to one topic, read one after another, waiting to go
/// to the hub as one run ([`Hub::publish_run`]: one lookup, one inbox record per interested
/// shard): flushed before the connection's next other request and at the end of its input,
/// so that they reach the hub in the order they were read, before anything after them.
#[derive(Default)]
struct PublishRun {
    topic: String,
    messages: Vec<Message>,
}

impl PublishRun {
    /// Adds a publish of `message` to `topic`, flushing the run of another topic first.
    fn add(&mut self, hub: &Hub, topic: &str, message: Message) {
        if self.topic != topic {
            self.flush(hub);
            self.topic.clear();
            self.topic.push_str(topic);
        }
        self.messages.push(message);
    }

    /// Publishes the run, if there is one.
    fn flush(&mut self, hub: &Hub) {
        if !self.messages.is_empty() {
            hub.publish_run(&self.topic, &mut self.messages);
            // A burst's run is not kept for every input after it.
            if self.messages.capacity() > KEEP_RUN {
                self.messages = Vec::new();
            }
        }
    }
}

/// How often [`Shard::tick`] looks at a connection with a wall-clock expiry (a token's `exp`, a
/// client certificate's `notAfter`) before it is due: what bounds how late the expiry is seen
/// after the system clock jumps forward.
const RECHECK: Duration = Duration::from_secs(1);

/// A shard's connections by token, with when each is next due for [`Shard::tick`].
///
/// An idle connection costs the shard nothing between its deadlines: a tick looks only at the
/// connections whose `due` time has come (a scan of 8 bytes a connection), not at every
/// connection's state. `due` is reset whenever a connection is reached mutably
/// ([`get_mut`](Self::get_mut), which every change to a connection goes through), so a change
/// that brings a deadline forward (a stall, held input, a close begun) is looked at by the
/// next tick; the tick then sets it to the connection's next deadline (a keepalive ping at the
/// latest, where keepalive runs), at most [`RECHECK`] ahead for a wall-clock expiry.
#[derive(Default)]
struct Slots {
    conns: Vec<Option<Box<Conn>>>,
    /// Per token: the tick time (milliseconds since the shard's epoch) before which the
    /// connection has nothing due; 0 for "at the next tick".
    due: Vec<u64>,
}

impl Slots {
    /// Appends an empty slot; returns its token.
    fn push_empty(&mut self) -> Token {
        self.conns.push(None);
        self.due.push(0);
        (self.conns.len() - 1) as Token
    }

    fn put(&mut self, token: Token, conn: Box<Conn>) {
        self.conns[token as usize] = Some(conn);
        self.due[token as usize] = 0;
    }

    fn take(&mut self, token: Token) -> Option<Box<Conn>> {
        self.conns.get_mut(token as usize)?.take()
    }

    /// The connection in slot `token`, if the slot is occupied.
    fn get(&self, token: Token) -> Option<&Conn> {
        self.conns.get(token as usize)?.as_deref()
    }

    /// The connection in slot `token`, if the slot is occupied, due at the next tick.
    fn get_mut(&mut self, token: Token) -> Option<&mut Conn> {
        let c = self.conns.get_mut(token as usize)?.as_deref_mut()?;
        self.due[token as usize] = 0;
        Some(c)
    }

    /// The live connection `key` names, if it is still the slot's tenant (due at the next
    /// tick).
    fn get_key(&mut self, key: ConnKey) -> Option<&mut Conn> {
        let c = self.get_mut(key.index)?;
        (c.key.generation == key.generation).then_some(c)
    }

    fn iter(&self) -> impl Iterator<Item = &Conn> {
        self.conns.iter().flatten().map(|c| &**c)
    }
}

/// Where a connection's handling panicked (see `Shard::fail`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Decoding and running what it sent.
    Input,
    /// Framing what it is sent (the transport plugin's encoder).
    Output,
}

impl Stage {
    fn as_str(self) -> &'static str {
        match self {
            Stage::Input => "input",
            Stage::Output => "output",
        }
    }
}

/// A shard's state, living on its thread.
pub(crate) struct Shard<B: Backend> {
    handle: Arc<ShardHandle>,
    shared: Arc<Shared>,
    backend: B,
    slots: Slots,
    generations: Vec<u32>,
    /// Free tokens, the lowest taken first: tokens stay compact, so that on io_uring a new
    /// connection gets a slot of the ring's table of direct descriptors (which covers the low
    /// tokens) whenever one is free, also after a burst took tokens past the table.
    free: BinaryHeap<Reverse<u32>>,
    /// Connections with bytes to send.
    dirty: Vec<Token>,
    /// This shard's descriptors of the listening sockets (every shard accepts on each), by
    /// listener index.
    listeners: Vec<Option<OwnedFd>>,
    drain_deadline: Option<Instant>,
    finishing: bool,
    /// Output memory of connections freed since the allocator was last asked to return free
    /// memory to the system (see [`TICK`]'s handling in `tick`).
    freed_output: usize,
    /// The origin of the connections' millisecond timestamps.
    epoch: Instant,
    /// Spare send states (see [`SendState`]), boxed: a box moves to a connection and back
    /// without being allocated again.
    #[allow(clippy::vec_box)]
    spare_sends: Vec<Box<SendState>>,
    /// Sends started since the last wait, and their bytes (see `engine.turn_gap_us`).
    pass_sends: usize,
    pass_bytes: usize,
    /// The next fan-out waits until then (see `engine.turn_gap_us`).
    quiet_until: Option<Instant>,
    /// When the last pass that sent ended, or the gap that followed it: a pass that begins
    /// within half a gap of it, on a shard whose [`Load`] is busy, is followed by the gap (see
    /// [`wants_gap`]).
    last_sent: Option<Instant>,
    /// How busy the shard has been lately (see [`wants_gap`]).
    load: Load,
    /// The subscriptions of this shard's connections, by topic.
    fanout: Fanout,
    /// Scratch: what was taken from the inbox, and one topic's run of it.
    taken: Vec<Tapped>,
    run: Vec<Arc<Entry>>,
    /// The publishes of the connection whose input runs, waiting to go to the hub as one.
    publish_run: PublishRun,
    /// Failed accepts: when one was last logged, and how many failed since without a line (out
    /// of descriptors, a listener fails again at every wait: one line a second says it).
    accept_warned: Option<Instant>,
    accept_failures: u64,
}

/// At most one `accept failed` line per shard in this long.
const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(1);

impl<B: Backend> Shard<B> {
    pub(crate) fn new(
        handle: Arc<ShardHandle>,
        shared: Arc<Shared>,
        backend: B,
        listeners: Vec<Option<OwnedFd>>,
    ) -> Self {
        let fanout = Fanout::new(Arc::clone(&shared), Arc::clone(&handle));
        Shard {
            handle,
            shared,
            backend,
            slots: Slots::default(),
            generations: Vec::new(),
            free: BinaryHeap::new(),
            dirty: Vec::new(),
            listeners,
            drain_deadline: None,
            finishing: false,
            freed_output: 0,
            epoch: Instant::now(),
            spare_sends: Vec::new(),
            pass_sends: 0,
            pass_bytes: 0,
            quiet_until: None,
            last_sent: None,
            load: Load::new(Instant::now(), sys::thread_cpu_time()),
            fanout,
            taken: Vec::new(),
            run: Vec::new(),
            publish_run: PublishRun::default(),
            accept_warned: None,
            accept_failures: 0,
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
        let gap = self.shared.config.engine.turn_gap();
        loop {
            let now = Instant::now();
            // In the gap after a pass of small sends (`wants_gap`), publications gather.
            if self.quiet_until.is_none_or(|q| now >= q) {
                self.quiet_until = None;
                self.fan_out_listed(now);
            }
            self.drain_queue();
            self.flush_writes();
            if self.pass_sends > 0 {
                let idle_before = self
                    .last_sent
                    .map_or(Duration::MAX, |t| now.saturating_duration_since(t));
                // The sends run now (io_uring runs them at submission), so that `end` is when
                // they ended: taken before, it would count their time as idle, and a busy
                // io_uring shard would never see itself busy (`wants_gap`).
                self.backend.submit();
                let mut end = Instant::now();
                let busy = self.load.busy;
                if wants_gap(self.pass_sends, self.pass_bytes, gap, idle_before, busy) {
                    // Many small segments on a busy shard: the next fan-out waits `gap` after
                    // these sends end, and what is published meanwhile goes out in fewer,
                    // larger ones.
                    end += gap;
                    self.quiet_until = Some(end);
                }
                self.last_sent = Some(end);
            }
            self.pass_sends = 0;
            self.pass_bytes = 0;
            if self.finishing && self.slots.iter().next().is_none() {
                break;
            }
            let now = Instant::now();
            let mut timeout = next_tick.saturating_duration_since(now);
            self.handle.parker.park_begin();
            if !self.handle.queue.is_empty() {
                timeout = Duration::ZERO;
            } else {
                // After `park_begin`: a publisher that listed the inbox before either shows
                // here or sees the shard parked and wakes it (see [`Parker`]); a listing not
                // taken yet is work too (see `DirtyFlag::is_listed`).
                if !self.handle.inbox.is_empty() || self.handle.listed.is_listed() {
                    let at = self.quiet_until.unwrap_or(now);
                    timeout = timeout.min(at.saturating_duration_since(now));
                }
            }
            if let Err(e) = self.backend.wait(Some(timeout), &mut events) {
                tracing::error!(error = %e, backend = self.backend.name(), "backend wait failed");
                std::thread::sleep(Duration::from_millis(1));
            }
            self.handle.parker.park_end();
            for event in events.drain(..) {
                self.handle_event(event);
            }
            let now = Instant::now();
            self.load.turned(now, sys::thread_cpu_time);
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
                ShardMsg::NewConn {
                    fd,
                    listener,
                    over_limit,
                } => self.add_conn(fd, listener, over_limit),
                ShardMsg::Drain { deadline } => {
                    self.close_listeners();
                    self.drain_deadline = Some(deadline);
                }
                // Release pairs with `has_stopped_reading`'s Acquire.
                ShardMsg::StopReading => self.handle.stopped_reading.store(true, Ordering::Release),
                ShardMsg::Finish => {
                    self.close_listeners();
                    // Everything published before the shutdown reaches its subscribers first.
                    self.fan_out_listed(Instant::now());
                    self.finishing = true;
                    let tokens: Vec<Token> = self.live_tokens();
                    let now = Instant::now();
                    // A connection closed before (over `max_connections`, say) waits for its
                    // peer's close no longer than one closed now does.
                    let linger_until = millis(self.epoch, now + SHUTDOWN_LINGER);
                    for t in tokens {
                        if let Some(c) = self.slots.get_mut(t) {
                            if let State::Lingering(until) = c.state {
                                c.state = State::Lingering(until.min(linger_until));
                            }
                            c.push.shutdown(now);
                        }
                        self.settle(t);
                    }
                }
            }
        }
    }

    fn live_tokens(&self) -> Vec<Token> {
        self.slots.iter().map(|c| c.key.index).collect()
    }

    fn close_listeners(&mut self) {
        for i in 0..self.listeners.len() {
            // A connection waiting in the listen backlog is established for its client, which
            // may have sent its commands already: it is accepted and served, not reset with
            // the socket.
            if let Some(fd) = self.listeners[i].as_ref().map(AsRawFd::as_raw_fd) {
                let mut waiting = Vec::new();
                let _ = sys::accept_waiting(fd, i, &mut waiting);
                for event in waiting {
                    if let Event::Accept { listener, result } = event {
                        self.on_accept(listener, result);
                    }
                }
            }
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
        let shared = Arc::clone(&self.shared);
        let spec = &shared.listeners[listener];
        let now = Instant::now();
        // The transport plugin makes the connection's protocol, and `PushConnection::new` asks
        // its encoder what it writes: a plugin that panics there loses this connection (its
        // socket is closed, as no protocol exists to say why), not the shard.
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let proto = spec.factory.new_connection(&spec.protocol_limits);
            let conn_id = shared.next_conn_id.fetch_add(1, Ordering::Relaxed);
            let session = Session::with_shared_config(conn_id, Arc::clone(&shared.session_config));
            let session = match &*shared.auth.read() {
                Some(policy) => session.with_auth(policy.clone()),
                None => session,
            };
            PushConnection::new(proto, session, &shared.push_config, now)
        }));
        let push = match made {
            Ok(Ok(p)) => p,
            Ok(Err(e)) => {
                // Validated at start; unreachable in practice, and never a panic.
                tracing::error!(error = %e, "invalid outbox configuration");
                self.release_count(over_limit);
                return;
            }
            Err(panic) => {
                tracing::error!(
                    shard = self.handle.index,
                    listener = %spec.addr,
                    panic = %crate::hub::panic_message(&*panic),
                    "the listener's transport plugin panicked making a connection; closing it"
                );
                self.release_count(over_limit);
                return;
            }
        };
        let tls = match &spec.tls {
            None => None,
            Some((_, config)) => match TlsLayer::new(Arc::clone(&config.read())) {
                Ok(layer) => Some(Box::new(layer)),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start a TLS session");
                    self.release_count(over_limit);
                    return;
                }
            },
        };
        let index = match self.free.pop() {
            Some(Reverse(i)) => i,
            None => {
                self.generations.push(0);
                self.slots.push_empty()
            }
        };
        let key = ConnKey {
            shard: self.handle.index as u32,
            index,
            generation: self.generations[index as usize],
        };
        if let Err(e) = self.backend.add_conn(index, fd) {
            tracing::warn!(error = %e, "cannot register a connection");
            self.free.push(Reverse(index));
            self.release_count(over_limit);
            return;
        }
        let conn = Box::new(Conn {
            push,
            tls,
            key,
            reported_backlog: 0,
            send: None,
            sent_recently: false,
            recv_inflight: false,
            peer_eof: false,
            poll_inflight: false,
            state: State::Open,
            counted: !over_limit,
        });
        let max = shared.config.limits.max_connections;
        self.slots.put(index, conn);
        self.handle.conns.fetch_add(1, Ordering::Relaxed);
        if over_limit {
            let msg =
                format!("the server holds its maximum of max_connections = {max} connections");
            self.close_with(index, Ending::limit("max_connections", msg));
            if self.slots.get(index).is_some_and(|c| c.tls.is_some()) {
                // The error goes through TLS once the handshake is done: read it.
                self.arm_recv(index);
            }
        } else {
            self.arm_recv(index);
        }
        self.mark_dirty(index);
    }

    fn release_count(&self, over_limit: bool) {
        if !over_limit {
            self.shared.open.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn arm_recv(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.recv_inflight || matches!(c.state, State::Dead) {
            return;
        }
        c.recv_inflight = true;
        self.backend.recv(token);
    }

    fn handle_event(&mut self, event: Event) {
        match event {
            Event::Accept { listener, result } => self.on_accept(listener, result),
            Event::Recv { token, result, buf } => {
                let result = result.map(|n| (n, buf));
                self.on_recv(token, result);
                if let Some(buf) = buf {
                    self.backend.release_buf(buf);
                }
            }
            Event::Send { token, result } => {
                self.on_send(token, result);
                self.resume_input(token);
            }
            Event::Writable { token } => self.on_writable(token),
        }
    }

    fn on_accept(&mut self, listener: usize, result: io::Result<RawFd>) {
        let fd = match result {
            // SAFETY: the backend hands over a socket the kernel just created for us.
            Ok(fd) => unsafe { OwnedFd::from_raw_fd(fd) },
            Err(e) => {
                self.accept_failures += 1;
                let now = Instant::now();
                if self
                    .accept_warned
                    .is_none_or(|t| now.duration_since(t) >= ACCEPT_WARN_EVERY)
                {
                    let failures = std::mem::take(&mut self.accept_failures);
                    tracing::warn!(error = %e, listener, failures, "accept failed");
                    self.accept_warned = Some(now);
                }
                return;
            }
        };
        if self.listeners.get(listener).is_none_or(Option::is_none) {
            return;
        }
        let counters = self.shared.counters_of(self.handle.index);
        counters.accepted.fetch_add(1, Ordering::Relaxed);
        let max = self.shared.config.limits.max_connections;
        // Every shard accepts: the check and the count are one step, so that two shards
        // accepting at once cannot both take the last place.
        let admitted = self
            .shared
            .open
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |open| {
                (open < max).then_some(open + 1)
            })
            .is_ok();
        if !admitted {
            counters.rejected.fetch_add(1, Ordering::Relaxed);
            counters.limit_errors.fetch_add(1, Ordering::Relaxed);
            // Said to the client and logged when it closes.
            self.add_conn(fd, listener, true);
            return;
        }
        if matches!(
            self.shared.listeners[listener].addr,
            super::config::ListenAddr::Tcp(_)
        ) {
            set_tcp_option(&fd, libc::TCP_NODELAY, 1);
            // The kernel keeps at most this much of a connection's output not yet sent, and
            // says the socket is writable once half of it went out. A reader that reads, however
            // slowly, is seen to drain (liveness) each time it took that much, not only once a
            // send buffer of megabytes has a third free; and what waits for a slow reader waits
            // in the outbox, under the push-stream rules, rather than in the kernel. A reader
            // that keeps up never has this much unsent.
            set_tcp_option(&fd, libc::TCP_NOTSENT_LOWAT, SEND_LOWAT as libc::c_int);
        }
        let shards = self.shared.shards();
        // Round-robin over every shard, whichever accepted (see `Shared::next_owner`). During a
        // shutdown's drain the accepting shard keeps it: its own quiet check then waits for what
        // the client sent, where another shard may have said it was quiet already.
        let draining = self.drain_deadline.is_some();
        let target = if draining {
            self.handle.index
        } else {
            self.shared.next_owner.fetch_add(1, Ordering::Relaxed) % shards.len()
        };
        if target == self.handle.index {
            self.add_conn(fd, listener, false);
        } else {
            shards[target].send(ShardMsg::NewConn {
                fd,
                listener,
                over_limit: false,
            });
        }
    }

    /// A receive finished with `n` bytes in lent buffer `buf` (given back by the caller).
    fn on_recv(&mut self, token: Token, result: io::Result<(usize, Option<sys::BufId>)>) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        c.recv_inflight = false;
        match (c.state, result) {
            (State::Dead, _) => self.free_if_idle(token),
            (State::Closing(_), Ok((n, buf))) if n > 0 => {
                if let Some(tls) = c.tls.as_deref_mut().filter(|t| t.is_handshaking()) {
                    // Closed before its TLS handshake completed (over max_connections, say): the
                    // handshake is read on, so that the error it is closed with can be said
                    // through it. What the client sends inside is not read.
                    let data = buf.map_or(&[][..], |buf| self.backend.recv_buf(buf, n));
                    let mut ignored = bytes::BytesMut::new();
                    if tls.receive(data, &mut ignored).is_err() {
                        tls.take_ciphertext();
                        tls.failed = true;
                    }
                    self.mark_dirty(token);
                }
                self.arm_recv(token);
            }
            (State::Lingering(_), Ok((n, _))) if n > 0 => self.arm_recv(token),
            (State::Lingering(_), _) => self.abort(token),
            (State::Closing(_), Ok(_)) => c.peer_eof = true,
            (_, Ok((0, _))) => {
                c.peer_eof = true;
                self.on_peer_end(token);
            }
            (_, Ok((_, _))) if self.handle.has_stopped_reading() => {
                // The shutdown's reading is over: what arrives now is not read (the connection
                // is told `shutdown` after what was published before).
                self.arm_recv(token);
            }
            (_, Ok((n, buf))) => {
                self.shared
                    .counters_of(self.handle.index)
                    .bytes_in
                    .fetch_add(n as u64, Ordering::Relaxed);
                debug_assert!(buf.is_some(), "a receive with bytes lends a buffer");
                let data = buf.map_or(&[][..], |buf| self.backend.recv_buf(buf, n));
                let now = Instant::now();
                let mut established = false;
                // The peer's `close_notify`: the end of its stream, as a TCP end of stream is.
                let mut tls_ended = false;
                if let Some(tls) = c.tls.as_deref_mut() {
                    c.push.count_received(n);
                    let handshaking = tls.is_handshaking();
                    let received = tls.receive(data, c.push.inbuf_mut());
                    if let Err(e) = received {
                        // The alert rustls queued goes out; nothing more does.
                        tls.take_ciphertext();
                        tls.failed = true;
                        let ending = Ending::unsaid(e.code(), e.to_string());
                        self.close_with(token, ending);
                        self.mark_dirty(token);
                        return;
                    }
                    tls_ended = matches!(received, Ok(true));
                    established = handshaking && !tls.is_handshaking();
                    if tls.has_output() || established {
                        // A handshake message to answer, or the handshake just completed.
                        self.dirty.push(token);
                    }
                } else if c.push.counts().bytes_in == 0 && looks_like_tls(data) {
                    // A TLS client on a listener without TLS: said at once, in plaintext (the
                    // client reads a broken record and stops), rather than waiting out the
                    // first-message deadline on bytes that are no line.
                    c.push.count_received(n);
                    let msg = "this listener does not speak TLS (a TLS handshake arrived); \
                               connect without TLS, or to a listener with tls_cert";
                    self.close_with(
                        token,
                        Ending::wrong_protocol(codes::TLS_NOT_ENABLED, msg.to_owned()),
                    );
                    return;
                } else if let Some(buf) = buf.filter(|_| n >= TAKE_RECV_MIN) {
                    // A well-filled receive is decoded where it lies: the buffer becomes the
                    // connection's input (the lines share it), and the pool gets a new one.
                    c.push.receive_owned(self.backend.take_buf(buf, n));
                } else {
                    c.push.receive(data);
                }
                if established {
                    // A client certificate bounds the connection's life by its `notAfter`, and
                    // one listed in `[[auth.certificates]]` authenticates the connection before
                    // any of its commands is read.
                    let tls = c.tls.as_deref();
                    let wall = SystemTime::now();
                    let valid_until = tls.and_then(|t| t.peer_valid_until(wall));
                    let subject = tls.and_then(TlsLayer::peer_subject);
                    if valid_until.is_some() || subject.is_some() {
                        c.push
                            .certificate_verified(subject.as_ref(), valid_until, now, wall);
                        if c.push.state() != PushState::Open {
                            self.settle(token);
                            return;
                        }
                    }
                }
                // A panic in the handling (the server's fault, or a transport plugin's) ends
                // this connection, said in its protocol; the shard and its other connections go
                // on.
                let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    self.after_input(token, false)
                }));
                if let Err(panic) = handled {
                    self.fail(token, &*panic, Stage::Input);
                    return;
                }
                if tls_ended {
                    self.on_peer_end(token);
                }
                if let Some(c) = self.slots.get_mut(token) {
                    // Input is quiet from when it was handled: handling a large receive can take
                    // longer than a shutdown's quiet period.
                    c.push.touch_input(Instant::now());
                }
                // Input left waiting for the output to drain: nothing more is read until it
                // is handled (`resume_input`), so TCP holds the client back.
                if self.slots.get(token).is_some_and(|c| {
                    matches!(c.state, State::Open | State::Closing(_)) && !c.push.input_waiting()
                }) {
                    self.arm_recv(token);
                }
            }
            (_, Err(e)) => {
                self.abort_with(token, Ending::unsaid("receive_failed", e.to_string()));
            }
        }
    }

    /// The peer ended its stream (its end of stream, or a TLS `close_notify`): what it cut short
    /// is read (a last line without its newline) or refused, said; what was published before
    /// is fanned out (the connection's own last publish to its own subscription included); then
    /// what is queued is written, and the connection closes. Once the shutdown's reading is
    /// over, nothing more is read.
    fn on_peer_end(&mut self, token: Token) {
        if !self.handle.has_stopped_reading() {
            let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.after_input(token, true);
                self.fan_out_listed(Instant::now());
            }));
            if let Err(panic) = handled {
                self.fail(token, &*panic, Stage::Input);
                return;
            }
        }
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.push.input_waiting() {
            // The peer's last commands wait for the output to drain: the close follows them
            // (`resume_input`).
            c.peer_eof = true;
            return;
        }
        if c.state == State::Open {
            self.close_with(token, Ending::unsaid("peer_closed", String::new()));
        }
    }

    /// After a write: input left waiting for the output to drain (see
    /// [`PushConnection::input_waiting`]) is handled once the output is back under its mark;
    /// then the connection reads again, or, when the peer had ended its stream, closes as the
    /// peer did.
    fn resume_input(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        // Once the shutdown's reading is over, held input stays unhandled too: another shard
        // may have closed its connections, and a publish now would reach only some of them.
        if c.state != State::Open
            || !c.push.input_waiting()
            || c.push.input_held(Instant::now())
            || self.handle.has_stopped_reading()
        {
            return;
        }
        let handled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.run_input(token, Instant::now(), SystemTime::now());
        }));
        if let Err(panic) = handled {
            self.fail(token, &*panic, Stage::Input);
            return;
        }
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        c.push.touch_input(Instant::now());
        if c.state != State::Open || c.push.input_waiting() {
            return;
        }
        if c.peer_eof {
            self.fan_out_listed(Instant::now());
            self.close_with(token, Ending::unsaid("peer_closed", String::new()));
        } else {
            self.arm_recv(token);
        }
    }

    /// Closes a connection whose handling panicked with `panic` in `stage`, logged at `error`.
    /// After its input, with the `internal_error` error in its protocol (at once if saying it
    /// panics too); after framing its output, at once (its encoder cannot be trusted to say
    /// it).
    fn fail(&mut self, token: Token, panic: &(dyn std::any::Any + Send), stage: Stage) {
        let what = crate::hub::panic_message(panic);
        tracing::error!(
            shard = self.handle.index,
            panic = %what,
            stage = stage.as_str(),
            "handling a connection panicked; closing that connection"
        );
        if stage == Stage::Input {
            let message = "the server failed while handling this connection's input".to_owned();
            let said = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.close_with(token, Ending::internal(message))
            }));
            if said.is_ok() {
                return;
            }
        }
        self.abort_with(token, Ending::unsaid(codes::INTERNAL_ERROR, what));
    }

    /// Decodes what arrived (at the peer's `end` of stream, all of it) and runs the push
    /// connection on it: what it asks for (fan-out, subscriptions, publishes) is done here, in
    /// the order it asks.
    fn after_input(&mut self, token: Token, end: bool) {
        let now = Instant::now();
        let wall = SystemTime::now();
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.state != State::Open {
            c.push.discard_input();
            return;
        }
        c.push.decode_input(now, end);
        self.run_input(token, now, wall);
    }

    /// Runs the push connection on its decoded input: what it asks for (fan-out,
    /// subscriptions, publishes) is done here, in the order it asks, until the input is handled
    /// or waits for the output to drain.
    fn run_input(&mut self, token: Token, now: Instant, wall: SystemTime) {
        loop {
            let Some(c) = self.slots.get_mut(token) else {
                self.publish_run.flush(&self.shared.hub);
                return;
            };
            let Some(request) = c.push.poll(now, wall) else {
                break;
            };
            // Before any other request, what the connection published goes to the hub.
            match request {
                Request::Publish { message } => {
                    let mut topics = c.push.publish_topics();
                    match topics.next() {
                        // Without an id nothing is said of what it reached: it waits, with the
                        // connection's publishes to the same one topic that follow it, for one
                        // publish of the run. (A publish to two topics, a device's, goes at
                        // once: a run would change the order a subscriber of both sees.)
                        Some(topic) if topics.len() == 0 && !c.push.publish_wants_reach() => {
                            self.publish_run.add(&self.shared.hub, topic, message);
                            c.push.publish_done(Ok(0), now);
                        }
                        _ => {
                            self.publish_run.flush(&self.shared.hub);
                            let result =
                                publish(&self.shared.hub, c.push.publish_topics(), message);
                            c.push.publish_done(result, now);
                        }
                    }
                }
                Request::PublishRun { mut messages } => {
                    self.publish_run.flush(&self.shared.hub);
                    if let Some(topic) = c.push.publish_topics().next() {
                        self.shared.hub.publish_run(topic, &mut messages);
                    }
                }
                Request::FanOut => {
                    self.publish_run.flush(&self.shared.hub);
                    self.fan_out_listed(now);
                }
                Request::Subscribe {
                    subscription_id,
                    hub_id,
                    topic,
                } => {
                    self.publish_run.flush(&self.shared.hub);
                    self.subscribe(token, subscription_id, hub_id, &topic, now);
                }
                Request::Unsubscribe {
                    subscription_id,
                    topic,
                } => {
                    self.publish_run.flush(&self.shared.hub);
                    self.unsubscribe(token, subscription_id, &topic, now);
                }
            }
        }
        self.publish_run.flush(&self.shared.hub);
        self.mark_dirty(token);
        self.settle(token);
    }

    /// Adds a push subscription of connection `token` to the shard's fan-out of `topic` (after
    /// delivering what the inbox holds, published before it, to the subscriptions there were),
    /// then answers the connection (its `subscribed` reply goes before any delivery to it).
    fn subscribe(
        &mut self,
        token: Token,
        subscription_id: Arc<str>,
        hub_id: Arc<str>,
        topic: &str,
        now: Instant,
    ) {
        self.fan_out_listed(now);
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        // Another subscription of this connection to the topic (its session lists its own).
        let also_subscribed = c
            .push
            .session()
            .subscriptions()
            .any(|(id, info)| info.topic == topic && *id != subscription_id);
        let sub = LocalSub {
            conn: c.key,
            id: Arc::clone(&subscription_id),
            hub_id,
            hub_frames: c.push.hub_frames(),
            repeated: false,
            bytes_sent: Arc::default(),
        };
        let transport: Arc<dyn std::any::Any + Send + Sync> = Arc::new(subscription_id);
        let result = if self
            .fanout
            .subscribe(topic, sub, transport, also_subscribed)
        {
            Ok(())
        } else {
            Err(crate::hub::SubscribeError::Closed)
        };
        c.push.subscribe_done(result, now);
    }

    /// Removes a push subscription after delivering what the inbox holds (published before the
    /// unsubscribe), then answers the connection (the outbox drops the subscription's pending
    /// coalescible frames and queues the acknowledgement).
    fn unsubscribe(&mut self, token: Token, subscription_id: Arc<str>, topic: &str, now: Instant) {
        self.fan_out_listed(now);
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        self.fanout.unsubscribe(topic, c.key, &subscription_id);
        c.push.unsubscribe_done(now);
    }

    /// Brings the socket's state in line with the push connection's after a call into it: its
    /// error counts go to the shard's counters; a close it decided starts closing the socket
    /// (its subscriptions leave the fan-out); an abort closes it now.
    fn settle(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        let (limit_errors, protocol_errors) = c.push.take_errors();
        self.freed_output += c.push.take_freed();
        let (push_state, state) = (c.push.state(), c.state);
        if limit_errors > 0 || protocol_errors > 0 {
            let counters = self.shared.counters_of(self.handle.index);
            counters
                .limit_errors
                .fetch_add(u64::from(limit_errors), Ordering::Relaxed);
            counters
                .protocol_errors
                .fetch_add(u64::from(protocol_errors), Ordering::Relaxed);
        }
        match (push_state, state) {
            (PushState::Closing, State::Open) => self.begin_close(token),
            (PushState::Aborted, s) if s != State::Dead => self.abort(token),
            _ => {}
        }
    }

    /// Fans out what the inbox holds when called, in the order it came: each run of one
    /// topic's publications in batches of at most `subscriptions.max_batch`. What publishers
    /// add meanwhile waits for the next call (the inbox stays non-empty, so the shard does not
    /// sleep), so a shard that publishers keep busy still gets to its IO.
    fn fan_out_listed(&mut self, now: Instant) {
        // Before the drain: see the fan-out module's listing handshake.
        self.handle.listed.take();
        let held = self.handle.inbox.len();
        let mut taken = std::mem::take(&mut self.taken);
        while taken.len() < held {
            match self.handle.inbox.pop() {
                Some(t) => taken.push(t),
                None => break,
            }
        }
        let mut run = std::mem::take(&mut self.run);
        // Runs of one topic's publications; a hub close (`Publications::Closed`) is a group of
        // its own.
        let open = |t: &Tapped| !matches!(t.publications, Publications::Closed);
        let same_run = |a: &Tapped, b: &Tapped| {
            (a.slot, a.generation) == (b.slot, b.generation) && open(a) && open(b)
        };
        for group in taken.chunk_by_mut(same_run) {
            let (slot, generation) = (group[0].slot, group[0].generation);
            if !open(&group[0]) {
                // After what came before, the topic ends.
                self.end_topic(slot, generation, now);
                continue;
            }
            // The entries move out of the inbox's records: no reference count changes.
            for t in group.iter_mut() {
                t.publications.take_into(&mut run);
            }
            self.fan_out_run(slot, generation, &run, now);
            run.clear();
        }
        taken.clear();
        self.taken = taken;
        self.run = run;
    }

    /// Fans out one run of the publications of topic `slot` (if `generation` is still its
    /// tenant): batches of at most `subscriptions.max_batch`, as other shards sealed them where
    /// they did, each encoded once per wire format for every shard, the same `Bytes` into every
    /// local subscriber's outbox.
    fn fan_out_run(&mut self, slot: u32, generation: u32, run: &[Arc<Entry>], now: Instant) {
        let Some(topic) = self.fanout.topic(slot, generation) else {
            return;
        };
        let max_batch = self.shared.config.subscriptions.max_batch.max(1);
        let (mut deliveries, mut messages, mut encoded) = (0u64, 0u64, 0u64);
        let wants_lines = topic.subs.len() > topic.hub_frame_subs;
        let wants_frames = topic.hub_frame_subs > 0;
        let mut rest = run;
        while !rest.is_empty() {
            // The batch another shard cut from the same publications, if it did (then its
            // encodings are shared too), else one cut here: see `hub::SealedBatch`. Each
            // publication taken from the inbox is cut at most once (`rest` only moves on):
            // the seal's count of the shards still to cut there relies on it.
            let sealed = SealedBatch::cut(rest, max_batch);
            let (batch, after) = rest.split_at(sealed.len());
            rest = after;
            // Push messages are JSON; a binary message published into the hub has no NDJSON
            // or JSON-frame form and is left out (the hub's own subscribers can take it).
            let count = batch.iter().filter(|e| e.message.is_json()).count();
            if count == 0 {
                continue;
            }
            let batch_lines = |encoded: &mut u64| {
                let (lines, fresh) = sealed.lines(batch);
                *encoded += u64::from(fresh);
                lines
            };
            let mut lines = wants_lines.then(|| batch_lines(&mut encoded));
            let frame = if wants_frames {
                let (frame, fresh) = sealed.frame(batch);
                encoded += u64::from(fresh);
                frame.unwrap_or_else(|e| {
                    tracing::warn!(topic = &*topic.name, error = %e, "cannot frame a batch");
                    None
                })
            } else {
                None
            };
            for sub in &topic.subs {
                if sub.repeated {
                    // Below, with its connection's other subscriptions to the topic.
                    continue;
                }
                let Some(c) = self.slots.get_key(sub.conn) else {
                    continue;
                };
                if c.state != State::Open {
                    continue;
                }
                if c.push.takes_frames() {
                    let Some(frame) = &frame else { continue };
                    // One frame per batch: lossless and in order with the replies, written as
                    // it is (the frame protocol's wire form is the hub frame).
                    c.push.deliver_frame(frame.clone(), now);
                    sub.count_sent(frame.len());
                } else {
                    // Lines, under the outbox's rules: a frame-protocol subscriber behind its
                    // socket gets them too (see `PushConnection::takes_frames`), encoded here
                    // only then.
                    let lines = lines.get_or_insert_with(|| batch_lines(&mut encoded));
                    c.push.deliver_lines(&sub.id, lines.clone(), now);
                    sub.count_sent(lines.len());
                }
                deliveries += 1;
                messages += count as u64;
                self.dirty.push(sub.conn.index);
            }
            if topic.repeated > 0 {
                if let Some(lines) = &lines {
                    let n =
                        deliver_interleaved(&mut self.slots, &mut self.dirty, topic, lines, now);
                    deliveries += n;
                    messages += n * count as u64;
                }
            }
        }
        if deliveries > 0 {
            self.shared
                .counters_of(self.handle.index)
                .frames_out
                .fetch_add(deliveries, Ordering::Relaxed);
            self.shared.hub.count_tapped(messages, encoded);
        }
    }

    /// The hub closed: each subscription of topic `slot` (if `generation` is still its tenant)
    /// is told and its connection closed, and the topic leaves the table.
    fn end_topic(&mut self, slot: u32, generation: u32, now: Instant) {
        let Some(topic) = self.fanout.topic(slot, generation) else {
            return;
        };
        let ended: Vec<(ConnKey, Arc<str>)> = topic
            .subs
            .iter()
            .map(|s| (s.conn, Arc::clone(&s.id)))
            .collect();
        self.fanout.remove_topic(slot);
        for (key, sub) in ended {
            if let Some(c) = self.slots.get_key(key).filter(|c| c.state == State::Open) {
                c.push.subscription_ended(&sub, now);
                self.settle(key.index);
            }
        }
    }

    /// Starts one send per dirty connection that has bytes to send and none in flight.
    fn flush_writes(&mut self) {
        let now = Instant::now();
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for &token in &dirty {
            let Some(c) = self.slots.get_mut(token) else {
                continue;
            };
            if c.state == State::Open {
                if c.push.check_limits(now) {
                    self.shared.hub.count_tap_disconnect();
                }
                self.settle(token);
            }
            // Framing the output runs the transport plugin's encoder: a panic there ends this
            // connection at once (its encoder cannot be trusted to say it), not the shard.
            let sent =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.start_send(token)));
            if let Err(panic) = sent {
                self.fail(token, &*panic, Stage::Output);
            }
        }
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    fn start_send(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.send.is_some()
            || c.poll_inflight
            || matches!(c.state, State::Dead | State::Lingering(_))
        {
            return;
        }
        if c.tls.is_some() {
            self.start_send_tls(token);
            return;
        }
        let Some(s) = self.gather(token) else {
            self.nothing_to_send(token);
            return;
        };
        self.submit_send(token, s);
    }

    /// The plaintext of the connection's next write, as a send (see
    /// [`PushConnection::poll_transmit`]); `None` when there is nothing to write.
    fn gather(&mut self, token: Token) -> Option<Box<SendState>> {
        let c = self.slots.get_mut(token)?;
        let mut s = self.spare_sends.pop().unwrap_or_else(SendState::new);
        match c.push.poll_transmit(&mut s.chunks, MAX_IOV, Instant::now()) {
            Some(transmit) => {
                s.transmit = Some(transmit);
                s.tls = 0;
                Some(s)
            }
            None => {
                self.recycle_send(s);
                None
            }
        }
    }

    /// Nothing is left to write: a closing connection's protocol close message goes last (then
    /// TLS's `close_notify`), then the close.
    fn nothing_to_send(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        // The push connection's close message went with its last bytes (`poll_transmit`).
        let written = c.push.is_written() && c.tls.as_ref().is_none_or(|t| !t.has_output());
        let failed = c.tls.as_ref().is_some_and(|t| t.failed);
        // A TLS session whose handshake is not finished by a deadline the peer let pass (the
        // first message's, say) will not finish to carry the deadline's error, and one that is
        // not finished when the server shuts down is not waited for (a port scanner's or a
        // health check's connection would hold the shutdown to its deadline, as an HTTP
        // upgrade under way is answered 503 at once): what TLS itself can say (`close_notify`,
        // an alert) is all the peer gets, at once, not at the close deadline. Other closes
        // (over `max_connections` at accept) wait for the handshake to say why, within the
        // close deadline.
        let unsayable = c.tls.as_ref().is_some_and(|t| {
            t.is_handshaking()
                && !t.has_output()
                && c.push
                    .ending()
                    .is_some_and(|e| e.is_timeout() || e.is_shutdown())
        });
        if !matches!(c.state, State::Closing(_)) || !(written || failed || unsayable) {
            return;
        }
        if !failed {
            if let Some(tls) = c.tls.as_deref_mut() {
                if tls.close_notify() {
                    self.start_send(token);
                    return;
                }
            }
        }
        self.finish_close(token);
    }

    /// A TLS connection's next write: the ciphertext still pending, else what [`Shard::gather`]
    /// offers, encrypted (as much as rustls takes: the rest stays under the outbox's rules).
    fn start_send_tls(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        let Some(tls) = c.tls.as_deref() else {
            return;
        };
        if tls.pending.is_empty() && !tls.failed && !tls.is_handshaking() {
            if let Some(plain) = self.gather(token) {
                let now = Instant::now();
                let Some(c) = self.slots.get_mut(token) else {
                    return;
                };
                let Some(tls) = c.tls.as_deref_mut() else {
                    return;
                };
                let taken = tls.encrypt(&plain.chunks);
                if let Some(transmit) = plain.transmit {
                    c.push.on_written(transmit, taken, now);
                }
                self.recycle_send(plain);
            }
        }
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        c.sync_backlog(self.shared.counters_of(self.handle.index));
        let Some(tls) = c.tls.as_deref_mut() else {
            return;
        };
        tls.take_ciphertext();
        if tls.pending.is_empty() {
            self.nothing_to_send(token);
            return;
        }
        let mut s = self.spare_sends.pop().unwrap_or_else(SendState::new);
        s.chunks.push(tls.pending.clone());
        s.transmit = None;
        s.tls = tls.pending.len();
        self.submit_send(token, s);
    }

    /// Hands `s` to the kernel as the connection's send in flight.
    fn submit_send(&mut self, token: Token, mut s: Box<SendState>) {
        let Some(c) = self.slots.get_mut(token) else {
            self.recycle_send(s);
            return;
        };
        self.pass_sends += 1;
        self.pass_bytes += s.transmit.map_or(0, |t| t.len()) + s.tls;
        let SendState {
            chunks, iov, msg, ..
        } = &mut *s;
        iov.extend(chunks.iter().map(|chunk| libc::iovec {
            iov_base: chunk.as_ptr() as *mut libc::c_void,
            iov_len: chunk.len(),
        }));
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len() as _;
        let msg: *const libc::msghdr = msg;
        c.send = Some(s);
        c.sent_recently = true;
        self.shared
            .counters_of(self.handle.index)
            .send_syscalls
            .fetch_add(1, Ordering::Relaxed);
        // SAFETY: `msg`, its iovecs and the chunks they point to live in the boxed send state,
        // which stays in `c.send` (so neither moves nor is freed or touched) until the `Send`
        // completion takes it out; the connection is not freed while a send is in flight (see
        // `free_if_idle`). The chunks are `Bytes` clones: their memory stays put even if the
        // outbox drops its own references.
        unsafe { self.backend.send(token, msg) };
    }

    /// Keeps a finished send's state for the next send (bounded), dropping its chunks.
    fn recycle_send(&mut self, mut s: Box<SendState>) {
        s.chunks.clear();
        s.iov.clear();
        s.transmit = None;
        s.msg.msg_iov = std::ptr::null_mut();
        s.msg.msg_iovlen = 0;
        if self.spare_sends.len() < SPARE_SENDS
            && s.chunks.capacity() <= SPARE_SEND_CAPACITY
            && s.iov.capacity() <= SPARE_SEND_CAPACITY
        {
            self.spare_sends.push(s);
        }
    }

    fn on_send(&mut self, token: Token, result: io::Result<usize>) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        let Some(send) = c.send.take() else {
            return;
        };
        let (transmit, send_tls) = (send.transmit, send.tls);
        self.recycle_send(send);
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.state == State::Dead {
            self.free_if_idle(token);
            return;
        }
        let now = Instant::now();
        let n = match result {
            Ok(n) => n,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                0
            }
            Err(e) => {
                self.abort_with(token, Ending::unsaid("send_failed", e.to_string()));
                return;
            }
        };
        self.shared
            .counters_of(self.handle.index)
            .bytes_out
            .fetch_add(n as u64, Ordering::Relaxed);
        if let Some(tls) = c.tls.as_deref_mut() {
            tls.written(n);
            let stalled = n < send_tls;
            c.push
                .on_below_written(tls.pending.len(), stalled, n > 0, now);
            c.sync_backlog(self.shared.counters_of(self.handle.index));
            if stalled {
                c.poll_inflight = true;
                self.backend.poll_writable(token);
            } else {
                if c.push.outbox().wants_writable() {
                    // rustls's buffer was full: the outbox's rest goes into the next records.
                    c.push.on_writable(now);
                }
                self.mark_dirty(token);
            }
            return;
        }
        let offered = transmit.map_or(0, |t| t.len());
        if let Some(transmit) = transmit {
            c.push.on_written(transmit, n, now);
        }
        c.sync_backlog(self.shared.counters_of(self.handle.index));
        if n < offered {
            // The socket did not take everything: paused until it drains.
            c.poll_inflight = true;
            self.backend.poll_writable(token);
        } else {
            self.mark_dirty(token);
        }
    }

    fn on_writable(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        c.poll_inflight = false;
        if c.state == State::Dead {
            self.free_if_idle(token);
            return;
        }
        c.push.on_writable(Instant::now());
        self.mark_dirty(token);
    }

    /// Closes for `ending`, saying it in the connection's protocol (see
    /// [`PushConnection`]'s close), then closes the socket once that is written.
    fn close_with(&mut self, token: Token, ending: Ending) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.state != State::Open {
            return;
        }
        c.push.close(ending, Instant::now());
        self.settle(token);
    }

    /// Closes at once for `ending` (unless an ending was decided before), saying nothing.
    fn abort_with(&mut self, token: Token, ending: Ending) {
        if let Some(c) = self.slots.get_mut(token) {
            c.push.abort(ending);
        }
        self.abort(token);
    }

    /// Graceful close: stop taking commands and deliveries, write what is queued, then shut down.
    fn begin_close(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.state != State::Open {
            return;
        }
        let now = Instant::now();
        let deadline = self
            .drain_deadline
            .map_or(now + CLOSE_FLUSH, |d| d.min(now + CLOSE_FLUSH).max(now));
        c.state = State::Closing(millis(self.epoch, deadline));
        self.release_session(token);
        self.mark_dirty(token);
    }

    /// Everything is written: shut the sending side down and linger for the peer's close, or
    /// close at once when the peer has closed already.
    fn finish_close(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.peer_eof && !c.recv_inflight {
            // The peer closed first and everything is written: closing the socket sends what
            // is left and then the end of stream, as a half-close would, and nothing can come
            // in to linger for. (On io_uring a direct descriptor's half-close is run by the
            // kernel's worker threads: a wake-up and two context switches per connection.)
            self.abort(token);
            return;
        }
        self.backend.shutdown(token, std::net::Shutdown::Write);
        // While shutting down, a peer that keeps its side open is not waited for long.
        let linger = if self.finishing {
            SHUTDOWN_LINGER
        } else {
            LINGER
        };
        c.state = State::Lingering(millis(self.epoch, Instant::now() + linger));
        self.arm_recv(token);
    }

    /// Ends the connection's push subscriptions (nothing more is delivered to it).
    fn release_session(&mut self, token: Token) {
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        for (id, info) in c.push.take_subscriptions() {
            self.fanout.unsubscribe(&info.topic, c.key, &id);
        }
    }

    /// Closes at once: no more writes.
    fn abort(&mut self, token: Token) {
        self.release_session(token);
        let Some(c) = self.slots.get_mut(token) else {
            return;
        };
        if c.state == State::Dead {
            return;
        }
        c.state = State::Dead;
        if c.recv_inflight || c.send.is_some() || c.poll_inflight {
            // Makes the in-flight operations complete; the slot is freed after the last one.
            self.backend.shutdown(token, std::net::Shutdown::Both);
        }
        self.free_if_idle(token);
    }

    /// Frees a dead connection's slot once no operation on it is in flight.
    fn free_if_idle(&mut self, token: Token) {
        let idx = token as usize;
        let Some(c) = self.slots.get(token) else {
            return;
        };
        if c.state != State::Dead || c.recv_inflight || c.send.is_some() || c.poll_inflight {
            return;
        }
        let c = self.slots.take(token).expect("checked above");
        self.freed_output += c.push.output_memory() + c.push.input_memory();
        self.backend.remove_conn(token); // closes the socket
        self.generations[idx] = self.generations[idx].wrapping_add(1);
        self.free.push(Reverse(token));
        self.handle.conns.fetch_sub(1, Ordering::Relaxed);
        let counters = self.shared.counters_of(self.handle.index);
        counters
            .unsent
            .fetch_sub(c.reported_backlog as usize, Ordering::Relaxed);
        counters.closed.fetch_add(1, Ordering::Relaxed);
        if c.counted {
            self.shared.open.fetch_sub(1, Ordering::Relaxed);
        }
        self.log_close(&c);
    }

    /// The one log line of a connection's close: why, and what it did. At `info` when the
    /// server decided the close (a limit, a deadline, a protocol error, a slow consumer, the
    /// shutdown's deadline), at `debug` when the peer closed or the server shut down in time.
    fn log_close(&self, c: &Conn) {
        let ending = c.push.ending();
        let reason = ending.map_or("closed", |e| e.reason);
        let detail = ending.map_or("", |e| e.detail.as_str());
        let subscriptions = ending.map_or(0, |e| e.subscriptions);
        let duration_ms = c.push.started().elapsed().as_millis() as u64;
        let counts = c.push.counts();
        macro_rules! line {
            ($level:ident) => {
                tracing::$level!(
                    shard = self.handle.index,
                    protocol = c.push.proto().name(),
                    reason,
                    detail,
                    bytes_in = counts.bytes_in,
                    bytes_out = counts.bytes_out,
                    messages_in = counts.messages_in,
                    deliveries = counts.deliveries,
                    subscriptions,
                    duration_ms,
                    "connection closed"
                )
            };
        }
        if ending.is_some_and(Ending::is_notable) {
            line!(info);
        } else {
            line!(debug);
        }
    }

    fn tick(&mut self, now: Instant) {
        // After connections that held much unsent output are gone (a burst of clients that
        // never read, closed at max_outbox_bytes), the memory goes back to the system now,
        // not whenever this thread's allocator next happens to purge.
        if self.freed_output >= RELEASE_AFTER_FREED {
            self.freed_output = 0;
            super::alloc::release_free_memory();
        }
        // The shutdown's deadline closes what is left only once the shard finishes (`Finish`):
        // before that another shard may still read, and publish to these connections.
        let drain_due = self.finishing && self.drain_deadline.is_some_and(|d| now >= d);
        let now_ms = millis(self.epoch, now);
        let wall = SystemTime::now();
        if self.drain_deadline.is_some() && !self.finishing && !self.handle.is_quiet() {
            // Input held back by its connection's output (see `PushConnection::input_waiting`)
            // is not quiet: the peer sent it, and its socket holds more that the shard reads
            // once the peer has read its replies, however long that takes within the budget.
            let quiet = self.slots.iter().all(|c| {
                c.state != State::Open
                    || (!c.push.input_waiting()
                        && now.saturating_duration_since(c.push.last_input()) >= DRAIN_QUIET)
            });
            if quiet {
                // Release pairs with `is_quiet`'s Acquire.
                self.handle.quiet.store(true, Ordering::Release);
            }
        }
        let mut due = Vec::new();
        let mut to_abort = Vec::new();
        // During a shutdown every connection is looked at: its deadline is the shutdown's.
        let every = self.drain_deadline.is_some();
        let tick_ms = TICK.as_millis() as u64;
        let recheck = now_ms + RECHECK.as_millis() as u64;
        let counters = self.shared.counters_of(self.handle.index);
        let Slots { conns, due: due_at } = &mut self.slots;
        for (i, (slot, due_at)) in conns.iter_mut().zip(due_at.iter_mut()).enumerate() {
            if !every && *due_at > now_ms {
                continue;
            }
            let Some(c) = slot.as_deref_mut() else {
                continue;
            };
            let token = i as Token;
            // What a paused connection was given since its send began (its sends sync the
            // counter, and a stalled one sends nothing) shows in `unsent_bytes` within a tick.
            c.sync_backlog(counters);
            // A connection that sent since the last tick is looked at again at the next.
            let mut next = if c.shrink_if_idle() {
                now_ms + tick_ms
            } else {
                u64::MAX
            };
            let (timeout, expires) = (c.push.poll_timeout(), c.push.expires_at());
            match c.state {
                // Whatever the ending was, it could not be written in time.
                State::Lingering(deadline) | State::Closing(deadline) if now_ms >= deadline => {
                    to_abort.push((token, Ending::unsaid("close_timeout", String::new())));
                    next = 0;
                }
                // A connection closed before the shutdown (at `max_connections`, say) lingers
                // for its peer no longer than the shutdown's deadline.
                State::Lingering(_) | State::Closing(_) | State::Open if drain_due => {
                    to_abort.push((token, Ending::unsaid("shutdown_timeout_ms", String::new())));
                    next = 0;
                }
                State::Open
                    if timeout.is_some_and(|t| t <= now)
                        || expires.is_some_and(|at| wall >= at) =>
                {
                    if c.poll_inflight && c.push.probe_writable(now) {
                        // A deadline for a peer that may not read (a held input, output past
                        // `max_outbox_bytes`), the socket's readiness awaited: a write now shows
                        // whether it reads (the wait ends with `Event::Writable`), before the
                        // deadline is judged.
                        self.backend.hurry_writable(token);
                    }
                    c.push.handle_timeout(now, wall);
                    due.push(token);
                    next = 0;
                }
                // Not due: when it is next (what handles it before then resets this).
                State::Lingering(deadline) | State::Closing(deadline) => next = next.min(deadline),
                State::Open => {
                    if let Some(t) = timeout {
                        next = next.min(millis(self.epoch, t));
                    }
                    if let Some(at) = expires {
                        let left = at.duration_since(wall).map_or(0, |d| d.as_millis() as u64);
                        next = next.min(now_ms.saturating_add(left)).min(recheck);
                    }
                }
                State::Dead => {}
            }
            *due_at = next;
        }
        for t in due {
            // A keepalive ping to write, or a close to begin; or input held for a peer that
            // reads nothing, handled again (see `PushConnection::input_waiting`).
            self.mark_dirty(t);
            self.settle(t);
            self.resume_input(t);
        }
        for (t, ending) in to_abort {
            self.abort_with(t, ending);
        }
    }
}

#[cfg(test)]
mod tests {
    /// A connection's state is what every idle connection costs: it stays within 512 bytes, an
    /// allocator size class (one more byte costs the next class, 640 bytes with mimalloc).
    #[test]
    fn connection_state_fits_in_512_bytes() {
        let size = std::mem::size_of::<super::Conn>();
        assert!(size <= 512, "Conn is {size} bytes");
    }

    /// `engine.turn_gap_us`: a pass of small sends on a busy shard is followed by the gap; a
    /// pass of large sends, a pass that sent nothing, a pass that found the shard idle (begun
    /// half a gap or more after the last sends), a shard whose load is not busy or a gap of
    /// zero lets the next turn run at once.
    #[test]
    fn the_turn_gap_follows_a_pass_of_small_sends_on_a_busy_shard_only() {
        use super::{wants_gap, SMALL_SEND_BYTES};
        use std::time::Duration;
        let gap = Duration::from_micros(100);
        let soon = Duration::from_micros(10);
        assert!(
            wants_gap(100, 100 * 94, gap, soon, true),
            "100 sends of one small message"
        );
        assert!(wants_gap(
            1,
            SMALL_SEND_BYTES - 1,
            gap,
            Duration::ZERO,
            true
        ));
        assert!(wants_gap(1, 64, gap, Duration::from_micros(49), true));
        assert!(
            !wants_gap(1, 64, gap, Duration::from_micros(50), true),
            "an idle shard: no gap"
        );
        assert!(
            !wants_gap(100, 100 * 94, gap, Duration::MAX, true),
            "the first sends: no gap"
        );
        assert!(
            !wants_gap(100, 100 * 94, gap, soon, false),
            "a steady stream that leaves the shard mostly waiting: no gap"
        );
        assert!(
            !wants_gap(1, SMALL_SEND_BYTES, gap, soon, true),
            "large sends: no gap"
        );
        assert!(!wants_gap(100, 100 * SMALL_SEND_BYTES, gap, soon, true));
        assert!(!wants_gap(0, 0, gap, soon, true), "nothing sent: no gap");
        assert!(
            !wants_gap(100, 100, Duration::ZERO, soon, true),
            "turned off"
        );
    }

    /// A shard's load is the share of the wall time its thread spent on the CPU, counted per
    /// span of at least `LOAD_WINDOW` (turns within one add up before it counts, and the clock
    /// is not read) and smoothed over `LOAD_MEMORY`: a shard on the CPU for three quarters of
    /// each span turns busy within a few spans and settles there; it stays busy while its share
    /// falls from `BUSY_FROM` to `BUSY_UNTIL`, and is idle under it; a long sleep replaces the
    /// share; a span whose clock cannot be read is not counted.
    #[test]
    fn a_shards_load_follows_the_share_of_its_time_spent_on_the_cpu() {
        use super::{Load, BUSY_FROM, BUSY_UNTIL, LOAD_WINDOW};
        use std::time::{Duration, Instant};
        let start = Instant::now();
        let mut cpu = Duration::from_secs(7);
        let mut load = Load::new(start, Some(cpu));
        let mut t = start;
        let (half, three_eighths) = (LOAD_WINDOW / 2, LOAD_WINDOW * 3 / 8);
        // Three quarters of each 5 ms span on the CPU, in two turns; each span weighs 1/4.
        let mut spans = 0;
        while !load.busy {
            t += half;
            cpu += three_eighths;
            load.turned(t, || panic!("read within a span"));
            t += half;
            cpu += three_eighths;
            load.turned(t, || Some(cpu));
            spans += 1;
            assert!(load.share <= 0.75 + f32::EPSILON);
        }
        assert_eq!(spans, 4, "0.19, 0.33, 0.43, then 0.51: busy");
        assert!(load.share >= BUSY_FROM);
        for _ in 0..20 {
            t += LOAD_WINDOW;
            cpu += three_eighths * 2;
            load.turned(t, || Some(cpu));
        }
        assert!(
            (load.share - 0.75).abs() < 0.01,
            "settles at 3/4: {}",
            load.share
        );
        // A fifth of each span: the share falls under BUSY_FROM, the shard stays busy until it
        // is under BUSY_UNTIL.
        let mut seen_between = false;
        while load.busy {
            t += LOAD_WINDOW;
            cpu += LOAD_WINDOW / 5;
            load.turned(t, || Some(cpu));
            seen_between |= load.busy && load.share < BUSY_FROM;
        }
        assert!(seen_between, "busy between the two thresholds");
        assert!(load.share < BUSY_UNTIL);
        // Busy again, then one long sleep: that span replaces the share.
        for _ in 0..20 {
            t += LOAD_WINDOW;
            cpu += LOAD_WINDOW;
            load.turned(t, || Some(cpu));
        }
        assert!(load.busy && load.share > 0.99);
        t += Duration::from_secs(1);
        load.turned(t, || Some(cpu));
        assert!(!load.busy && load.share < 0.01, "{}", load.share);
        // A clock that cannot be read: the span is not counted.
        t += LOAD_WINDOW;
        load.turned(t, || None);
        t += LOAD_WINDOW;
        cpu += LOAD_WINDOW;
        load.turned(t, || Some(cpu));
        assert!(load.share < 0.01, "no span counted across the failed read");
        t += LOAD_WINDOW;
        cpu += LOAD_WINDOW;
        load.turned(t, || Some(cpu));
        assert!((load.share - 0.25).abs() < 0.01, "{}", load.share);
    }
}
