//! The round-trip scenario: one message in flight at a time. A client publishes one message,
//! waits until its subscriber connection has it, and only then publishes the next; each round
//! trip's time is one sample. This is the latency of an unloaded server, the part of every
//! latency figure that the server's own work per message decides (no queueing, no batching, no
//! pacing by a load generator).
//!
//! The systems take turns block by block (ABBA), every block the same number of round trips on
//! the same client thread, so that the machine's phases weigh on every system alike; the rows
//! give each system's merged histogram, and the notes the median over the blocks of each
//! system's p50 and p99 divided by the first system's in the same block pair.

use std::io::{self, Read, Write};
use std::time::Instant;

use crate::load::new_histogram;
use crate::payload::Template;
use crate::procfs;
use crate::report::{Row, Scenario};
use crate::scenarios::{median_f64, paired_ratios, Ctx};
use crate::systems::{Decoder, Link, Target};

/// The topic (and the message's `stream`).
const TOPIC: &str = "rtt";

/// One system's connections: a subscriber and a publisher.
struct Pair {
    sub: Link,
    publisher: Link,
    decoder: Box<dyn Decoder>,
    /// Bytes read from the subscriber and not yet decoded.
    pending: Vec<u8>,
    template: Template,
    seq: u64,
    out: Vec<u8>,
}

impl Pair {
    fn open(t: &Target) -> io::Result<Pair> {
        let mut sub = t.open()?;
        let pending = t.wire.subscribe(&mut sub, TOPIC)?;
        let mut publisher = t.open()?;
        t.wire.hello_publisher(&mut publisher)?;
        // What a publisher is told (Redis answers every PUBLISH) is read and dropped by a
        // thread of its own, so that it never fills the socket.
        let Link::Plain(tcp) = &publisher else {
            return Err(io::Error::other("rtt runs over plaintext only"));
        };
        let mut drain = tcp.try_clone()?;
        drain.set_read_timeout(None)?;
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while matches!(drain.read(&mut buf), Ok(n) if n > 0) {}
        });
        Ok(Pair {
            sub,
            publisher,
            decoder: t.wire.decoder(),
            pending,
            template: Template::new(64, TOPIC, "t", ""),
            seq: 0,
            out: Vec::new(),
        })
    }

    /// One round trip: publish, then read until the subscriber has the message. Returns its
    /// time in nanoseconds.
    fn round_trip(&mut self, t: &Target) -> io::Result<u64> {
        self.seq += 1;
        self.out.clear();
        let msg = self.template.stamp(self.seq, 0);
        t.wire.encode_publish(TOPIC, msg, &mut self.out);
        let start = Instant::now();
        self.publisher.write_all(&self.out)?;
        let mut got = 0usize;
        let mut reply = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let used = self
                .decoder
                .decode(&self.pending, &mut |_| got += 1, &mut reply)?;
            self.pending.drain(..used);
            if !reply.is_empty() {
                self.sub.write_all(&reply)?;
                reply.clear();
            }
            if got > 0 {
                break;
            }
            let n = self.sub.read(&mut chunk)?;
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the subscriber's connection closed",
                ));
            }
            self.pending.extend_from_slice(&chunk[..n]);
        }
        let ns = start.elapsed().as_nanos() as u64;
        if got > 1 {
            return Err(io::Error::other(format!(
                "{got} messages arrived for one publish"
            )));
        }
        Ok(ns)
    }
}

/// Run the round-trip scenario: `2 × ctx.reps` blocks of `ctx.rtt_samples` round trips per
/// system.
pub(crate) fn run(ctx: &Ctx) -> io::Result<Scenario> {
    let mut sc = Scenario {
        name: "rtt".to_owned(),
        unit: "round trips/s".to_owned(),
        ..Scenario::default()
    };
    let targets: Vec<&Target> = ctx.targets.iter().filter(|t| !t.kind.is_tls()).collect();
    if targets.len() < ctx.targets.len() {
        sc.notes
            .push("TLS systems are left out of rtt (plaintext clients only).".to_owned());
    }
    let samples = ctx.rtt_samples;
    let blocks = ctx.reps * 2;
    ctx.pb.inc_length((blocks * targets.len()) as u64);
    // The client on the load generator's first CPU, as the other scenarios' publishers.
    let _ = procfs::pin_current(0);
    let mut pairs = Vec::new();
    for t in &targets {
        let mut p = Pair::open(t)?;
        // Warm-up: connections, caches and the server's buffers.
        for _ in 0..samples.min(500) {
            p.round_trip(t)?;
        }
        pairs.push(p);
    }
    let mut merged: Vec<_> = targets.iter().map(|_| new_histogram()).collect();
    // Per system, block by block: p50 and p99 in ns.
    let mut p50s: Vec<Vec<u64>> = vec![Vec::new(); targets.len()];
    let mut p99s: Vec<Vec<u64>> = vec![Vec::new(); targets.len()];
    let mut secs = vec![0f64; targets.len()];
    for b in 0..blocks {
        let order: Vec<usize> = if b % 2 == 0 {
            (0..targets.len()).collect()
        } else {
            (0..targets.len()).rev().collect()
        };
        for k in order {
            ctx.pb
                .set_message(format!("rtt block {} · {}", b + 1, targets[k].kind));
            let mut h = new_histogram();
            let start = Instant::now();
            for _ in 0..samples {
                match pairs[k].round_trip(targets[k]) {
                    Ok(ns) => {
                        h.saturating_record(ns);
                    }
                    Err(e) => {
                        sc.failures
                            .push(format!("rtt {}: {e}", targets[k].kind.name()));
                        return Ok(sc);
                    }
                }
            }
            secs[k] += start.elapsed().as_secs_f64();
            p50s[k].push(h.value_at_quantile(0.5));
            p99s[k].push(h.value_at_quantile(0.99));
            merged[k].add(&h).expect("histograms of one shape");
            ctx.pb.inc(1);
        }
    }
    for (k, t) in targets.iter().enumerate() {
        let mut note = format!("{blocks} blocks of {samples} round trips");
        if k > 0 {
            // Each block's figure over the first system's in the same pair of turns.
            let summary = |per: &[Vec<u64>]| {
                let r = paired_ratios(&per[0], &per[k]);
                let lo = r.iter().copied().fold(f64::INFINITY, f64::min);
                let hi = r.iter().copied().fold(0.0, f64::max);
                format!("{:.3}× ({lo:.3}–{hi:.3})", median_f64(&r))
            };
            note.push_str(&format!(
                "; ÷ {} block by block: p50 {}, p99 {}",
                targets[0].kind.name(),
                summary(&p50s),
                summary(&p99s)
            ));
        }
        sc.rows.push(Row {
            case: "1 in flight, 64 B".to_owned(),
            system: t.kind.name().to_owned(),
            is_powerhub: t.kind.is_powerhub(),
            is_peer: !t.kind.is_powerhub(),
            throughput: Some((blocks * samples) as f64 / secs[k].max(1e-9)),
            latency: Row::latency_of(&merged[k]),
            note,
            ..Row::default()
        });
    }
    sc.notes.push(
        "Closed loop: one publish in flight; a sample is the time from the publisher's write to the subscriber's read of the message (one client thread, pinned to the first CPU; each server as in the other scenarios).".to_owned(),
    );
    Ok(sc)
}
