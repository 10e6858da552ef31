//! The load generator: subscriber fleets read by a few polling threads, a pipelined publisher
//! (closed loop with a window, or open loop on a schedule), and the coordinator that runs one
//! measured case against one system.

use std::io::{self, ErrorKind, Read, Write};
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_utils::CachePadded;
use hdrhistogram::Histogram;
use mio::net::TcpStream as MioStream;
use mio::{Events, Interest, Poll, Token};

use crate::clock::{now_ns, precise_sleeps, wait_until};
use crate::payload::{parse_stamp, Template};
use crate::procfs::{self, RssPoint, RssSampler};
use crate::systems::{Decoder, Target};
use crate::tls::{SubStream, TlsWriter};

/// Messages per publisher write: the same pipelining depth for every system.
pub(crate) const PIPELINE: usize = 64;

/// A latency histogram: 1 ns to 10 s at 3 significant digits.
pub(crate) fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 10_000_000_000, 3).expect("valid histogram bounds")
}

/// How a subscriber reads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ReadMode {
    /// As fast as it can.
    Normal,
    /// At most this many bytes per second.
    Slow(u64),
    /// Never reads.
    Never,
}

/// What happened to one subscriber connection.
#[derive(Debug, Clone)]
pub(crate) struct SubOutcome {
    pub(crate) mode: ReadMode,
    pub(crate) received: u64,
    /// Sequence numbers skipped (dropped by the server).
    pub(crate) gaps: u64,
    /// Seconds after the case started at which the server closed the connection.
    pub(crate) closed_at: Option<f64>,
    /// The server closed the connection at an unknown time (seen behind unread bytes).
    pub(crate) closed_unseen: bool,
    /// Non-benchmark messages received (notifications such as `frames_dropped`).
    pub(crate) other: u64,
    pub(crate) frames_dropped: u64,
    pub(crate) bytes: u64,
    /// Highest sequence number received plus one.
    pub(crate) next_seq: u64,
}

struct SubState {
    received: CachePadded<AtomicU64>,
    /// Highest sequence number seen plus one (0 = none yet).
    next_seq: AtomicU64,
}

struct FleetShared {
    subs: Vec<SubState>,
    recording: AtomicBool,
    stop: AtomicBool,
    t0: u64,
}

struct ReaderOut {
    /// Paced (slow) readers' latencies are not merged with the normal readers'.
    slow: bool,
    hist: Histogram<u64>,
    outcomes: Vec<(usize, SubOutcome)>,
    errors: Vec<String>,
}

/// Connected subscribers and the threads reading them.
pub(crate) struct Fleet {
    shared: Arc<FleetShared>,
    modes: Vec<ReadMode>,
    threads: Vec<JoinHandle<ReaderOut>>,
}

struct Conn {
    idx: usize,
    stream: SubStream,
    buf: Vec<u8>,
    filled: usize,
    decoder: Box<dyn Decoder>,
    out: SubOutcome,
    expected: u64,
    reply: Vec<u8>,
    open: bool,
}

impl Conn {
    /// Read what is there (at most `budget` bytes); false once the connection is gone.
    fn pump(
        &mut self,
        shared: &FleetShared,
        hist: &mut Histogram<u64>,
        budget: usize,
    ) -> io::Result<bool> {
        let mut left = budget;
        while left > 0 {
            if self.filled == self.buf.len() {
                let len = self.buf.len() * 2;
                self.buf.resize(len, 0);
            }
            let room = (self.buf.len() - self.filled).min(left);
            let n = match self
                .stream
                .read(&mut self.buf[self.filled..self.filled + room])
            {
                Ok(0) => {
                    self.close(shared);
                    return Ok(false);
                }
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(true),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e)
                    if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) =>
                {
                    self.close(shared);
                    return Ok(false);
                }
                Err(e) => return Err(e),
            };
            left -= n;
            self.filled += n;
            self.out.bytes += n as u64;
            let now = now_ns();
            let record = shared.recording.load(Ordering::Relaxed);
            let out = &mut self.out;
            let expected = &mut self.expected;
            let used = self.decoder.decode(
                &self.buf[..self.filled],
                &mut |msg| match parse_stamp(msg) {
                    Some((seq, t)) => {
                        out.received += 1;
                        if seq > *expected {
                            out.gaps += seq - *expected;
                        }
                        *expected = (*expected).max(seq + 1);
                        if record {
                            let _ = hist.record(crate::payload::since(t, now).max(1));
                        }
                    }
                    None => {
                        out.other += 1;
                        if memchr::memmem::find(msg, b"\"frames_dropped\"").is_some() {
                            out.frames_dropped += 1;
                        }
                    }
                },
                &mut self.reply,
            )?;
            self.buf.copy_within(used..self.filled, 0);
            self.filled -= used;
            let st = &shared.subs[self.idx];
            st.received.store(self.out.received, Ordering::Release);
            st.next_seq.store(self.expected, Ordering::Release);
            if !self.reply.is_empty() {
                self.stream.write_all(&self.reply)?;
                self.reply.clear();
            }
            if n < room && matches!(self.stream, SubStream::Plain(_)) {
                // A short read drained the socket: bytes that arrive later raise a new
                // readiness edge, so the read that would only return `WouldBlock` is skipped
                // (it was every second system call of a reader).
                return Ok(true);
            }
        }
        Ok(true)
    }

    fn close(&mut self, shared: &FleetShared) {
        if self.open {
            self.open = false;
            self.out.closed_at = Some((now_ns() - shared.t0) as f64 / 1e9);
        }
    }
}

fn reader_loop(shared: Arc<FleetShared>, mut conns: Vec<Conn>) -> ReaderOut {
    let mut hist = new_histogram();
    let mut errors = Vec::new();
    let mut poll = match Poll::new() {
        Ok(p) => p,
        Err(e) => {
            errors.push(format!("epoll: {e}"));
            return finish(false, hist, conns, errors);
        }
    };
    for (i, c) in conns.iter_mut().enumerate() {
        if let Err(e) = poll
            .registry()
            .register(c.stream.socket(), Token(i), Interest::READABLE)
        {
            errors.push(format!("register: {e}"));
        }
        // Bytes that arrived with the subscription confirmation.
        if c.filled > 0 {
            let _ = c.pump(&shared, &mut hist, 0);
        }
    }
    let mut events = Events::with_capacity(1024);
    while !shared.stop.load(Ordering::Relaxed) {
        if let Err(e) = poll.poll(&mut events, Some(Duration::from_millis(20))) {
            if e.kind() != ErrorKind::Interrupted {
                errors.push(format!("poll: {e}"));
                break;
            }
        }
        for ev in events.iter() {
            let c = &mut conns[ev.token().0];
            if !c.open {
                continue;
            }
            if let Err(e) = c.pump(&shared, &mut hist, usize::MAX) {
                errors.push(format!("subscriber {}: {e}", c.idx));
                c.close(&shared);
            }
        }
    }
    finish(false, hist, conns, errors)
}

/// Slow and never-reading subscribers: a paced loop instead of readiness events.
fn slow_loop(shared: Arc<FleetShared>, mut conns: Vec<Conn>) -> ReaderOut {
    let mut hist = new_histogram();
    let mut errors = Vec::new();
    let tick = Duration::from_millis(10);
    while !shared.stop.load(Ordering::Relaxed) {
        for c in conns.iter_mut().filter(|c| c.open) {
            match c.out.mode {
                ReadMode::Slow(bps) => {
                    let budget = (bps / 100).max(1) as usize;
                    if let Err(e) = c.pump(&shared, &mut hist, budget) {
                        errors.push(format!("slow subscriber {}: {e}", c.idx));
                        c.close(&shared);
                    }
                }
                ReadMode::Never => {
                    if peer_closed(c.stream.socket()) {
                        c.close(&shared);
                    }
                }
                ReadMode::Normal => {}
            }
        }
        std::thread::sleep(tick);
    }
    // A server that closed a never-read connection is only visible behind the unread bytes:
    // read them (bounded) to find the end of the stream.
    for c in conns
        .iter_mut()
        .filter(|c| c.open && c.out.mode == ReadMode::Never)
    {
        let deadline = now_ns() + 500_000_000;
        let mut sink = vec![0u8; 1 << 20];
        let mut idle = 0;
        while now_ns() < deadline && idle < 4 {
            match c.stream.read(&mut sink) {
                Ok(0) => {
                    c.out.closed_unseen = true;
                    break;
                }
                Ok(_) => idle = 0,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    idle += 1;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e)
                    if matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe) =>
                {
                    c.out.closed_unseen = true;
                    break;
                }
                Err(_) => break,
            }
        }
    }
    finish(true, hist, conns, errors)
}

/// Whether the server closed (or reset) a connection we have not read, without reading it.
fn peer_closed(s: &MioStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut fd = libc::pollfd {
        fd: s.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd, zero timeout.
    let rc = unsafe { libc::poll(&mut fd, 1, 0) };
    rc > 0 && fd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

fn finish(slow: bool, hist: Histogram<u64>, conns: Vec<Conn>, errors: Vec<String>) -> ReaderOut {
    ReaderOut {
        slow,
        hist,
        outcomes: conns
            .into_iter()
            .map(|mut c| {
                c.out.next_seq = c.expected;
                (c.idx, c.out)
            })
            .collect(),
        errors,
    }
}

/// The fleet's results once stopped.
#[derive(Debug)]
pub(crate) struct FleetOut {
    pub(crate) hist: Histogram<u64>,
    pub(crate) subs: Vec<SubOutcome>,
    pub(crate) errors: Vec<String>,
}

impl Fleet {
    /// Connect and subscribe one connection per entry of `modes`, then start `readers` threads.
    pub(crate) fn connect(
        target: &Target,
        topic: &str,
        modes: &[ReadMode],
        readers: usize,
    ) -> io::Result<Fleet> {
        let readers = readers.max(1);
        let mut groups: Vec<Vec<Conn>> = (0..readers).map(|_| Vec::new()).collect();
        let mut slow = Vec::new();
        let subs = modes
            .iter()
            .map(|_| SubState {
                received: CachePadded::new(AtomicU64::new(0)),
                next_seq: AtomicU64::new(0),
            })
            .collect();
        for (idx, &mode) in modes.iter().enumerate() {
            let mut s = target.open()?;
            let leftover = target.wire.subscribe(&mut s, topic).map_err(|e| {
                io::Error::new(e.kind(), format!("{} subscriber {idx}: {e}", target.kind))
            })?;
            let s = s.into_sub()?;
            let mut buf = vec![0u8; 64 << 10];
            if leftover.len() > buf.len() {
                buf.resize(leftover.len(), 0);
            }
            buf[..leftover.len()].copy_from_slice(&leftover);
            let conn = Conn {
                idx,
                stream: s,
                buf,
                filled: leftover.len(),
                decoder: target.wire.decoder(),
                out: SubOutcome {
                    mode,
                    received: 0,
                    gaps: 0,
                    closed_at: None,
                    closed_unseen: false,
                    other: 0,
                    frames_dropped: 0,
                    bytes: 0,
                    next_seq: 0,
                },
                expected: 0,
                reply: Vec::new(),
                open: true,
            };
            match mode {
                ReadMode::Normal => groups[idx % readers].push(conn),
                _ => slow.push(conn),
            }
        }
        let shared = Arc::new(FleetShared {
            subs,
            recording: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            t0: now_ns(),
        });
        let mut threads = Vec::new();
        for g in groups.into_iter().filter(|g| !g.is_empty()) {
            let sh = shared.clone();
            threads.push(std::thread::spawn(move || reader_loop(sh, g)));
        }
        if !slow.is_empty() {
            let sh = shared.clone();
            threads.push(std::thread::spawn(move || slow_loop(sh, slow)));
        }
        Ok(Fleet {
            shared,
            modes: modes.to_vec(),
            threads,
        })
    }

    /// Deliveries so far, all subscribers.
    pub(crate) fn delivered(&self) -> u64 {
        self.shared
            .subs
            .iter()
            .map(|s| s.received.load(Ordering::Acquire))
            .sum()
    }

    /// The least progress (sequence numbers passed) among normal readers.
    pub(crate) fn min_progress(&self) -> u64 {
        self.shared
            .subs
            .iter()
            .zip(&self.modes)
            .filter(|(_, m)| **m == ReadMode::Normal)
            .map(|(s, _)| s.next_seq.load(Ordering::Acquire))
            .min()
            .unwrap_or(u64::MAX)
    }

    pub(crate) fn set_recording(&self, on: bool) {
        self.shared.recording.store(on, Ordering::Relaxed);
    }

    /// Stop the readers and collect what they saw.
    pub(crate) fn stop(self) -> FleetOut {
        self.shared.stop.store(true, Ordering::Relaxed);
        let mut hist = new_histogram();
        let mut subs: Vec<Option<SubOutcome>> = vec![None; self.modes.len()];
        let mut errors = Vec::new();
        for t in self.threads {
            match t.join() {
                Ok(out) => {
                    if !out.slow {
                        let _ = hist.add(&out.hist);
                    }
                    for (i, o) in out.outcomes {
                        subs[i] = Some(o);
                    }
                    errors.extend(out.errors);
                }
                Err(_) => errors.push("a reader thread panicked".to_owned()),
            }
        }
        FleetOut {
            hist,
            subs: subs.into_iter().flatten().collect(),
            errors,
        }
    }
}

/// How the publisher paces itself.
#[derive(Clone)]
pub(crate) enum Pace {
    /// Closed loop: at most this many messages ahead of the slowest normal reader.
    Window(u64),
    /// Open loop: message `seq` is due at the returned offset (ns after start) and uses the
    /// returned template; `None` ends the schedule.
    Schedule(Arc<dyn Fn(u64) -> Option<(u64, usize)> + Send + Sync>),
}

/// A fixed rate, forever.
pub(crate) fn rate(per_sec: f64) -> Pace {
    let interval = 1e9 / per_sec;
    Pace::Schedule(Arc::new(move |seq| {
        Some(((seq as f64 * interval) as u64, 0))
    }))
}

/// What the publisher did.
#[derive(Debug, Clone, Default)]
pub(crate) struct PubOut {
    pub(crate) sent: u64,
    pub(crate) secs: f64,
    /// Worst lateness of a write against its schedule (open loop), seconds.
    pub(crate) max_behind: f64,
    pub(crate) error: Option<String>,
}

/// One measured case: a fleet, a publisher, a warm-up, a measured window, a drain.
#[derive(Clone)]
pub(crate) struct CaseSpec {
    pub(crate) topic: String,
    pub(crate) modes: Vec<ReadMode>,
    pub(crate) templates: Vec<Template>,
    pub(crate) pace: Pace,
    pub(crate) warmup: Duration,
    pub(crate) measure: Duration,
    pub(crate) readers: usize,
    /// How long to wait after the publisher stopped for readers to get the last message.
    pub(crate) drain: Duration,
}

/// Everything measured in one case.
#[derive(Debug)]
pub(crate) struct CaseOut {
    pub(crate) deliveries: u64,
    pub(crate) secs: f64,
    pub(crate) cpu_secs: f64,
    pub(crate) peak_rss_kib: u64,
    pub(crate) rss: Vec<RssPoint>,
    pub(crate) publisher: PubOut,
    pub(crate) fleet: FleetOut,
    /// Messages normal readers did not receive.
    pub(crate) lost: u64,
    /// Normal readers that did not receive the last message.
    pub(crate) short: usize,
    /// Seconds from the start of the measured window to the end of the drain.
    pub(crate) until_drained: f64,
    /// Each run's throughput when the case ran more than once (see `combine_runs`).
    pub(crate) runs: Vec<f64>,
    /// Each run's p99 latency in ns when the case ran more than once: the spread says how far
    /// one run's percentile can be trusted.
    pub(crate) run_p99: Vec<u64>,
    /// How busy the load generator's CPUs were in the measured window (0–1), when known.
    pub(crate) gen_busy: Option<f64>,
}

impl CaseOut {
    pub(crate) fn throughput(&self) -> f64 {
        self.deliveries as f64 / self.secs.max(1e-9)
    }

    /// Server CPU-seconds per million deliveries.
    pub(crate) fn cpu_per_million(&self) -> f64 {
        self.cpu_secs / (self.deliveries.max(1) as f64 / 1e6)
    }
}

fn publisher_thread(
    target: &Target,
    spec_topic: String,
    mut templates: Vec<Template>,
    pace: Pace,
    stop: Arc<AtomicBool>,
    progress: Arc<dyn Fn() -> u64 + Send + Sync>,
) -> io::Result<JoinHandle<PubOut>> {
    let mut link = target.open()?;
    target.wire.hello_publisher(&mut link)?;
    // Replies (Redis `:N`, acknowledgements) are read and discarded so they never back up.
    let mut s = match TlsWriter::from_link(link)? {
        Ok(tls) => PubStream::Tls(tls),
        Err(s) => {
            s.set_read_timeout(None)?;
            let mut replies = s.try_clone()?;
            std::thread::spawn(move || {
                let mut sink = vec![0u8; 64 << 10];
                while let Ok(n) = replies.read(&mut sink) {
                    if n == 0 {
                        break;
                    }
                }
            });
            PubStream::Plain(s)
        }
    };
    let wire = target.wire.clone();
    Ok(std::thread::spawn(move || {
        precise_sleeps();
        let mut out = Vec::with_capacity(PIPELINE * (templates[0].len() + 64));
        let mut res = PubOut::default();
        let start = now_ns();
        let mut seq = 0u64;
        loop {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            out.clear();
            let mut done = false;
            match &pace {
                Pace::Window(w) => {
                    let mut spins = 0u32;
                    while seq.saturating_sub(progress()) + PIPELINE as u64 > *w {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        spins += 1;
                        if spins > 64 {
                            std::thread::sleep(Duration::from_micros(50));
                        } else {
                            std::thread::yield_now();
                        }
                    }
                    let t = now_ns();
                    for _ in 0..PIPELINE {
                        wire.encode_publish(&spec_topic, templates[0].stamp(seq, t), &mut out);
                        seq += 1;
                    }
                }
                Pace::Schedule(sched) => {
                    let now = now_ns() - start;
                    let mut next_due = None;
                    for k in 0..PIPELINE {
                        match sched(seq) {
                            None => {
                                done = true;
                                break;
                            }
                            Some((off, ti)) if off <= now => {
                                if k == 0 {
                                    res.max_behind = res.max_behind.max((now - off) as f64 / 1e9);
                                }
                                wire.encode_publish(
                                    &spec_topic,
                                    templates[ti].stamp(seq, start + off),
                                    &mut out,
                                );
                                seq += 1;
                            }
                            Some((off, _)) => {
                                next_due = Some(off);
                                break;
                            }
                        }
                    }
                    if out.is_empty() {
                        match next_due {
                            Some(off) => wait_until(start + off.min(now + 5_000_000)),
                            None => break,
                        }
                        continue;
                    }
                }
            }
            if let Err(e) = s.write_all(&out) {
                res.error = Some(format!("publish: {e}"));
                break;
            }
            res.sent = seq;
            if done {
                break;
            }
        }
        res.secs = (now_ns() - start) as f64 / 1e9;
        s.shutdown();
        res
    }))
}

/// A publisher's connection: a socket, or TLS over one.
enum PubStream {
    Plain(std::net::TcpStream),
    Tls(TlsWriter),
}

impl PubStream {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            PubStream::Plain(s) => s.write_all(bytes),
            PubStream::Tls(t) => t.write_all(bytes),
        }
    }

    fn shutdown(&self) {
        match self {
            PubStream::Plain(s) => {
                let _ = s.shutdown(Shutdown::Write);
            }
            PubStream::Tls(t) => t.shutdown(),
        }
    }
}

/// Run one case against `target`. `on_tick` is called about every 100 ms with the fraction done.
pub(crate) fn run_case(
    target: &Target,
    spec: CaseSpec,
    on_tick: &dyn Fn(f64),
) -> io::Result<CaseOut> {
    let fleet = Arc::new(Fleet::connect(
        target,
        &spec.topic,
        &spec.modes,
        spec.readers,
    )?);
    let sampler = RssSampler::start(target.pid, Duration::from_millis(50));
    let stop = Arc::new(AtomicBool::new(false));
    let f2 = fleet.clone();
    let progress: Arc<dyn Fn() -> u64 + Send + Sync> = Arc::new(move || f2.min_progress());
    let publisher = publisher_thread(
        target,
        spec.topic.clone(),
        spec.templates,
        spec.pace,
        stop.clone(),
        progress,
    )?;

    let total = (spec.warmup + spec.measure).as_secs_f64();
    let sleep_ticked = |from: f64, d: Duration| {
        let end = now_ns() + d.as_nanos() as u64;
        while now_ns() < end {
            std::thread::sleep(
                Duration::from_millis(100).min(Duration::from_nanos(end.saturating_sub(now_ns()))),
            );
            let done = from + (d.as_secs_f64() - (end.saturating_sub(now_ns()) as f64 / 1e9));
            on_tick(done / total);
        }
    };
    sleep_ticked(0.0, spec.warmup);
    let (d0, c0, t0) = (
        fleet.delivered(),
        procfs::cpu_seconds(target.pid)?,
        now_ns(),
    );
    let g0 = procfs::own_cpus_ticks().ok();
    fleet.set_recording(true);
    sleep_ticked(spec.warmup.as_secs_f64(), spec.measure);
    let (d1, c1, t1) = (
        fleet.delivered(),
        procfs::cpu_seconds(target.pid)?,
        now_ns(),
    );
    let g1 = procfs::own_cpus_ticks().ok();
    fleet.set_recording(false);
    stop.store(true, Ordering::Relaxed);
    let pub_out = publisher
        .join()
        .map_err(|_| io::Error::other("publisher panicked"))?;

    // Drain: wait (bounded) until every normal reader has the last message.
    let deadline = now_ns() + spec.drain.as_nanos() as u64;
    while fleet.min_progress() < pub_out.sent && now_ns() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let until_drained = (now_ns() - t0) as f64 / 1e9;
    let fleet = Arc::try_unwrap(fleet).map_err(|_| io::Error::other("fleet still shared"))?;
    let fleet_out = fleet.stop();
    let rss = sampler.finish();
    let peak = rss.iter().map(|p| p.1).max().unwrap_or(0);
    let normal = fleet_out.subs.iter().filter(|s| s.mode == ReadMode::Normal);
    let lost = normal
        .clone()
        .map(|s| pub_out.sent.saturating_sub(s.received))
        .sum();
    let short = normal.filter(|s| s.next_seq < pub_out.sent).count();
    Ok(CaseOut {
        deliveries: d1 - d0,
        secs: (t1 - t0) as f64 / 1e9,
        cpu_secs: c1 - c0,
        peak_rss_kib: peak,
        rss,
        publisher: pub_out,
        fleet: fleet_out,
        lost,
        short,
        until_drained,
        runs: Vec::new(),
        run_p99: Vec::new(),
        gen_busy: g0.zip(g1).and_then(|((b0, t0), (b1, t1))| {
            (t1 > t0).then(|| b1.saturating_sub(b0) as f64 / (t1 - t0) as f64)
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::systems::raw::{serve_on, RawWire};
    use crate::systems::SystemKind;
    use std::net::TcpListener;

    /// A raw baseline server on a thread of this process, stopped on drop.
    struct RawServer {
        target: Target,
        stop: Arc<AtomicBool>,
    }

    impl RawServer {
        fn start() -> RawServer {
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
            let addr = listener.local_addr().expect("local addr");
            let stop = Arc::new(AtomicBool::new(false));
            let s2 = stop.clone();
            std::thread::spawn(move || serve_on(listener, &s2));
            RawServer {
                target: Target {
                    kind: SystemKind::Raw,
                    addr,
                    pid: std::process::id(),
                    wire: Arc::new(RawWire),
                    backend: String::new(),
                    child: None,
                    policies: Vec::new(),
                    tls: None,
                },
                stop,
            }
        }
    }

    impl Drop for RawServer {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
        }
    }

    fn spec(modes: Vec<ReadMode>, pace: Pace) -> CaseSpec {
        CaseSpec {
            topic: "b".to_owned(),
            modes,
            templates: vec![Template::new(64, "b", "t", "")],
            pace,
            warmup: Duration::from_millis(50),
            measure: Duration::from_millis(200),
            readers: 2,
            drain: Duration::from_secs(10),
        }
    }

    #[test]
    fn closed_loop_fanout_counts_every_delivery_and_loses_none() {
        let server = RawServer::start();
        let out = run_case(
            &server.target,
            spec(vec![ReadMode::Normal; 5], Pace::Window(1024)),
            &|_| {},
        )
        .expect("case runs");
        assert!(out.publisher.sent > 0, "{out:?}");
        assert_eq!(out.lost, 0);
        assert_eq!(out.short, 0);
        assert!(out
            .fleet
            .subs
            .iter()
            .all(|s| s.received == out.publisher.sent && s.gaps == 0));
        assert!(out.deliveries > 0 && !out.fleet.hist.is_empty());
        assert!(out.fleet.errors.is_empty(), "{:?}", out.fleet.errors);
    }

    #[test]
    fn open_loop_stamps_the_scheduled_time_and_paced_readers_are_not_counted_as_lost() {
        let server = RawServer::start();
        let modes = vec![
            ReadMode::Normal,
            ReadMode::Normal,
            ReadMode::Slow(10_000),
            ReadMode::Never,
        ];
        let out =
            run_case(&server.target, spec(modes, rate(20_000.0)), &|_| {}).expect("case runs");
        assert!(out.publisher.sent > 0);
        // Only the two normal readers must have everything.
        assert_eq!(out.lost, 0);
        assert_eq!(out.short, 0);
        let slow = out
            .fleet
            .subs
            .iter()
            .find(|s| matches!(s.mode, ReadMode::Slow(_)))
            .expect("slow reader");
        assert!(slow.received < out.publisher.sent);
        let never = out
            .fleet
            .subs
            .iter()
            .find(|s| s.mode == ReadMode::Never)
            .expect("never-reader");
        assert_eq!(never.received, 0);
        // Latency is measured from the scheduled send time, so it is never negative: the
        // histogram's minimum is at least its 1 ns floor.
        assert!(out.fleet.hist.min() >= 1);
    }
}
