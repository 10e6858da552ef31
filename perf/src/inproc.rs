//! The in-process scenario: publish to N in-process subscribers from one thread while one other
//! thread drains every subscriber, with powerhub's hub (handlers on its handler pool, or inline
//! on its drain thread, and a
//! `Receiver` per subscriber drained by one consumer thread, taking owned or borrowed
//! messages), `tokio::sync::broadcast`, and a channel per subscriber (`crossbeam-channel`,
//! `flume`).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::payload::Template;
use crate::procfs;
use crate::report::{Row, Scenario};
use crate::scenarios::Ctx;
use crate::systems::powerhub;

/// What one in-process run did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct InprocOut {
    pub(crate) delivered: u64,
    pub(crate) lost: u64,
    pub(crate) secs: f64,
}

/// Broadcast capacity; the publisher stays within half of it so nothing lags.
const BROADCAST_CAP: usize = 1024;
/// Slots across all per-subscriber queues: fewer subscribers get deeper queues, between 256 and
/// the broadcast capacity.
const QUEUE_SLOTS: usize = 1 << 20;

/// The per-subscriber queue bound at `n` subscribers (channels, and the hub's `max_queue`).
fn queue(n: usize) -> usize {
    (QUEUE_SLOTS / n).clamp(256, BROADCAST_CAP)
}

/// The publisher runs on the first CPU and the draining thread on the last: the same two
/// threads for every system.
pub(crate) fn pin_consumer() {
    let n = procfs::cpus();
    if n > 1 {
        let _ = procfs::pin_current(n - 1);
    }
}

pub(crate) fn pin_publisher() {
    let _ = procfs::pin_current(0);
}

fn payload() -> Bytes {
    Bytes::copy_from_slice(Template::new(64, crate::scenarios::BENCH, "t", "").stamp(1, 1))
}

fn broadcast(n: usize, msgs: u64) -> InprocOut {
    use tokio::sync::broadcast::error::TryRecvError;
    let (tx, _) = tokio::sync::broadcast::channel::<Bytes>(BROADCAST_CAP);
    let mut rxs: Vec<_> = (0..n).map(|_| tx.subscribe()).collect();
    let sent = Arc::new(AtomicU64::new(0));
    let consumed = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let (s2, c2) = (sent.clone(), consumed.clone());
    let consumer = std::thread::spawn(move || {
        pin_consumer();
        let (mut delivered, mut lost) = (0u64, 0u64);
        let mut open = rxs.len();
        while open > 0 {
            let before = s2.load(Ordering::Acquire);
            open = 0;
            for rx in rxs.iter_mut() {
                loop {
                    match rx.try_recv() {
                        Ok(m) => {
                            // Every consumer reads the message it received (hands its bytes to
                            // `black_box`) and drops it.
                            std::hint::black_box(&m[..]);
                            delivered += 1;
                        }
                        Err(TryRecvError::Empty) => {
                            open += 1;
                            break;
                        }
                        Err(TryRecvError::Lagged(k)) => lost += k,
                        Err(TryRecvError::Closed) => break,
                    }
                }
            }
            // Everything sent before this pass began has been read by every receiver. Stored
            // only when it moved (as the powerhub consumer's floor): an idle pass writes no
            // line the publisher reads.
            if before != c2.load(Ordering::Relaxed) {
                c2.store(before, Ordering::Release);
            }
        }
        (delivered, lost)
    });
    let p = payload();
    for i in 0..msgs {
        while i - consumed.load(Ordering::Acquire) >= (BROADCAST_CAP / 2) as u64 {
            std::thread::yield_now();
        }
        let _ = tx.send(p.clone());
        sent.store(i + 1, Ordering::Release);
    }
    drop(tx);
    let (delivered, lost) = consumer.join().expect("consumer thread");
    InprocOut {
        delivered,
        lost,
        secs: start.elapsed().as_secs_f64(),
    }
}

/// What a channel per subscriber's receive found.
enum Got {
    Message,
    Empty,
    Closed,
}

/// A bounded channel per subscriber: the publisher sends each message into every channel (a
/// blocking send: nothing is dropped) and the consumer drains them all in turn.
fn per_subscriber<Tx, Rx>(
    n: usize,
    msgs: u64,
    bounded: impl Fn(usize) -> (Tx, Rx),
    send: impl Fn(&Tx, Bytes),
    try_recv: impl Fn(&Rx) -> Got + Send + 'static,
) -> InprocOut
where
    Rx: Send + 'static,
{
    let (txs, rxs): (Vec<Tx>, Vec<Rx>) = (0..n).map(|_| bounded(queue(n))).unzip();
    let start = Instant::now();
    let consumer = std::thread::spawn(move || {
        pin_consumer();
        let mut delivered = 0u64;
        let mut open = rxs.len();
        while open > 0 {
            open = 0;
            for rx in &rxs {
                loop {
                    match try_recv(rx) {
                        Got::Message => delivered += 1,
                        Got::Empty => {
                            open += 1;
                            break;
                        }
                        Got::Closed => break,
                    }
                }
            }
        }
        delivered
    });
    let p = payload();
    for _ in 0..msgs {
        for tx in &txs {
            send(tx, p.clone());
        }
    }
    drop(txs);
    let delivered = consumer.join().expect("consumer thread");
    InprocOut {
        delivered,
        lost: 0,
        secs: start.elapsed().as_secs_f64(),
    }
}

fn channels(n: usize, msgs: u64) -> InprocOut {
    use crossbeam_channel::TryRecvError;
    per_subscriber(
        n,
        msgs,
        crossbeam_channel::bounded::<Bytes>,
        |tx, m| {
            let _ = tx.send(m);
        },
        |rx| match rx.try_recv() {
            Ok(m) => {
                std::hint::black_box(&m[..]);
                Got::Message
            }
            Err(TryRecvError::Empty) => Got::Empty,
            Err(TryRecvError::Disconnected) => Got::Closed,
        },
    )
}

fn flume_channels(n: usize, msgs: u64) -> InprocOut {
    use flume::TryRecvError;
    per_subscriber(
        n,
        msgs,
        flume::bounded::<Bytes>,
        |tx, m| {
            let _ = tx.send(m);
        },
        |rx| match rx.try_recv() {
            Ok(m) => {
                std::hint::black_box(&m[..]);
                Got::Message
            }
            Err(TryRecvError::Empty) => Got::Empty,
            Err(TryRecvError::Disconnected) => Got::Closed,
        },
    )
}

/// The in-process systems by the keys `--inproc-systems` takes, in the order they run.
pub(crate) const SYSTEMS: [&str; 7] = [
    "hub",
    "hub-inline",
    "receivers",
    "receivers-borrowed",
    "broadcast",
    "crossbeam",
    "flume",
];

/// One in-process system's run.
type Runner = Box<dyn Fn() -> io::Result<InprocOut> + Send + Sync>;

/// Run the in-process scenario.
pub(crate) fn run(ctx: &Ctx) -> io::Result<Scenario> {
    let mut sc = Scenario {
        name: "in-process".to_owned(),
        unit: "deliveries/s".to_owned(),
        ..Scenario::default()
    };
    // `--inproc-systems` (checked against `SYSTEMS` before anything runs), or all.
    let selected = |key: &str| {
        ctx.inproc_systems
            .as_ref()
            .is_none_or(|keys| keys.iter().any(|k| k == key))
    };
    let per_case = SYSTEMS.iter().filter(|s| selected(s)).count();
    ctx.pb.inc_length((ctx.inproc_subs.len() * per_case) as u64);
    for &n in &ctx.inproc_subs {
        let msgs = (ctx.inproc_deliveries / n as u64).max(1000);
        let case = format!("N={n}");
        let all: [(&str, &str, bool, Runner); SYSTEMS.len()] = [
            (
                SYSTEMS[0],
                "powerhub hub",
                true,
                Box::new(move || powerhub::inproc(n, msgs, queue(n), payload(), false)),
            ),
            (
                SYSTEMS[1],
                "powerhub hub (inline handlers)",
                true,
                Box::new(move || powerhub::inproc(n, msgs, queue(n), payload(), true)),
            ),
            (
                SYSTEMS[2],
                "powerhub receivers",
                true,
                Box::new(move || powerhub::inproc_receivers(n, msgs, queue(n), payload(), false)),
            ),
            (
                SYSTEMS[3],
                "powerhub receivers (borrowed)",
                true,
                Box::new(move || powerhub::inproc_receivers(n, msgs, queue(n), payload(), true)),
            ),
            (
                SYSTEMS[4],
                "tokio broadcast",
                false,
                Box::new(move || Ok(broadcast(n, msgs))),
            ),
            (
                SYSTEMS[5],
                "crossbeam channels",
                false,
                Box::new(move || Ok(channels(n, msgs))),
            ),
            (
                SYSTEMS[6],
                "flume channels",
                false,
                Box::new(move || Ok(flume_channels(n, msgs))),
            ),
        ];
        let systems: Vec<(&str, bool, Runner)> = all
            .into_iter()
            .filter(|s| selected(s.0))
            .map(|(_, name, is_ph, f)| (name, is_ph, f))
            .collect();
        // Repetitions interleaved across the systems, so that the machine's noise (it is
        // shared) spreads over all of them; the median is reported.
        let mut runs: Vec<Vec<f64>> = vec![Vec::new(); systems.len()];
        let mut lost = vec![0u64; systems.len()];
        for _ in 0..ctx.reps {
            for (k, (name, _, f)) in systems.iter().enumerate() {
                ctx.pb.set_message(format!("in-process {case} · {name}"));
                let res = std::thread::scope(|s| {
                    s.spawn(|| {
                        pin_publisher();
                        f()
                    })
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("panicked")))
                });
                match res {
                    Ok(out) => {
                        let expected = n as u64 * msgs;
                        let l = expected.saturating_sub(out.delivered) + out.lost;
                        if l > 0 {
                            sc.failures.push(format!(
                                "in-process {case} {name}: {l} of {expected} deliveries missing"
                            ));
                        }
                        lost[k] += l;
                        runs[k].push(out.delivered as f64 / out.secs.max(1e-9));
                    }
                    Err(e) => sc.failures.push(format!("in-process {case} {name}: {e}")),
                }
            }
        }
        for (k, (name, is_ph, _)) in systems.iter().enumerate() {
            let r = &mut runs[k];
            if r.is_empty() {
                continue;
            }
            r.sort_by(f64::total_cmp);
            sc.rows.push(Row {
                case: case.clone(),
                system: (*name).to_owned(),
                is_powerhub: *is_ph,
                is_peer: !is_ph,
                // With an even number of runs, the slower of the middle two.
                throughput: Some(r[(r.len() - 1) / 2]),
                lost: Some(lost[k]),
                note: format!(
                    "{msgs} messages of 64 B; median of {} runs ({:.2}–{:.2} M/s)",
                    r.len(),
                    r[0] / 1e6,
                    r[r.len() - 1] / 1e6
                ),
                ..Row::default()
            });
            ctx.pb.inc(1);
        }
    }
    sc.notes.push(
        "powerhub receivers: the publisher publishes through the topic's Publisher handle (as broadcast's through its Sender); one consumer thread drains every Receiver with try_recv (as the broadcast and channel consumers drain theirs) while the hub's drain thread hands batches over; that third thread runs on the publisher's CPU (the publisher yields while a window ahead), not on the consumer's, which spins.".to_owned(),
    );
    sc.notes.push(format!(
        "One publishing thread and one thread draining every subscriber; bounded queues everywhere (broadcast capacity {BROADCAST_CAP} with the publisher kept within half of it, per-subscriber channels and hub queues of {QUEUE_SLOTS}/N clamped to 256..={BROADCAST_CAP}, the hub's publisher also kept within half of it); every message must reach every subscriber."
    ));
    Ok(sc)
}
