//! `powerhub::ring::Ring` against `crossbeam_queue::ArrayQueue` and `crossbeam_channel::bounded`.
//!
//! ```text
//! cargo bench -p powerhub --bench ring -- --warm-up-time 1 --measurement-time 3
//! ```
//!
//! - `transfer/1p1c`, `transfer/2p1c`: values moved from producer threads to one consumer
//!   through a queue of 1024; a full queue makes producers back off (spin, then yield) and retry,
//!   an empty one makes the consumer back off. The machine may have fewer free cores than
//!   threads: yielding keeps a waiting thread from burning the time slice the other one needs.
//!   One iteration is 10 000 values delivered.
//! - `force_push_full`: one thread overwriting into a full queue of 1024 (drop-oldest); the
//!   channel has no overwrite, so it is not in this group.
//! - `push_pop_uncontended`: one thread pushes then pops one value: the cost of the two
//!   operations with no other thread touching the queue.
//!
//! `POWERHUB_RING_INTERLEAVED=1 cargo bench -p powerhub --bench ring` instead runs the transfer
//! scenarios in interleaved rounds (every queue once per round) and prints medians and ratios:
//! on a shared machine that comparison is fairer than criterion's back-to-back groups.

// `criterion_group!` generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, BenchmarkId, Criterion, Throughput};
use crossbeam_queue::ArrayQueue;
use crossbeam_utils::Backoff;
use powerhub::ring::Ring;

const CAPACITY: usize = 1024;

/// The operations the benchmarks need, over each queue under test.
trait Queue: Send + Sync + 'static {
    fn name() -> &'static str;
    fn with_capacity(capacity: usize) -> Self;
    fn try_push(&self, v: u64) -> Result<(), u64>;
    fn try_pop(&self) -> Option<u64>;
}

impl Queue for Ring<u64> {
    fn name() -> &'static str {
        "powerhub::Ring"
    }
    fn with_capacity(capacity: usize) -> Self {
        Ring::new(capacity)
    }
    fn try_push(&self, v: u64) -> Result<(), u64> {
        self.push(v).map_err(|e| e.0)
    }
    fn try_pop(&self) -> Option<u64> {
        self.pop()
    }
}

impl Queue for ArrayQueue<u64> {
    fn name() -> &'static str {
        "crossbeam::ArrayQueue"
    }
    fn with_capacity(capacity: usize) -> Self {
        ArrayQueue::new(capacity)
    }
    fn try_push(&self, v: u64) -> Result<(), u64> {
        self.push(v)
    }
    fn try_pop(&self) -> Option<u64> {
        self.pop()
    }
}

/// Both ends of a bounded crossbeam channel, so it fits the same shape.
struct Channel(
    crossbeam_channel::Sender<u64>,
    crossbeam_channel::Receiver<u64>,
);

impl Queue for Channel {
    fn name() -> &'static str {
        "crossbeam_channel::bounded"
    }
    fn with_capacity(capacity: usize) -> Self {
        let (tx, rx) = crossbeam_channel::bounded(capacity);
        Channel(tx, rx)
    }
    fn try_push(&self, v: u64) -> Result<(), u64> {
        self.0.try_send(v).map_err(|e| e.into_inner())
    }
    fn try_pop(&self) -> Option<u64> {
        self.1.try_recv().ok()
    }
}

/// Moves `total` values from `producers` threads to the calling thread; returns the time taken.
fn transfer<Q: Queue>(producers: u64, total: u64) -> Duration {
    let queue = Arc::new(Q::with_capacity(CAPACITY));
    let per = total / producers;
    let total = per * producers;
    let start = Arc::new(std::sync::Barrier::new(producers as usize + 1));
    let handles: Vec<_> = (0..producers)
        .map(|_| {
            let queue = Arc::clone(&queue);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                for i in 0..per {
                    let mut v = i;
                    let backoff = Backoff::new();
                    while let Err(back) = queue.try_push(v) {
                        v = back;
                        backoff.snooze();
                    }
                }
            })
        })
        .collect();
    start.wait();
    let began = Instant::now();
    let mut received = 0;
    let backoff = Backoff::new();
    while received < total {
        match queue.try_pop() {
            Some(v) => {
                black_box(v);
                received += 1;
                backoff.reset();
            }
            None => backoff.snooze(),
        }
    }
    let elapsed = began.elapsed();
    for h in handles {
        h.join().unwrap();
    }
    elapsed
}

/// Values delivered per benchmark iteration of the transfer group.
const BATCH: u64 = 10_000;

fn bench_transfer(c: &mut Criterion) {
    type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;
    fn one<Q: Queue>(group: &mut Group<'_>, producers: u64) {
        group.bench_function(BenchmarkId::from_parameter(Q::name()), |b| {
            // Threads start once per sample and move `iters` batches, so start-up is amortised.
            b.iter_custom(|iters| transfer::<Q>(producers, iters * BATCH))
        });
    }
    for producers in [1u64, 2] {
        let mut group = c.benchmark_group(format!("transfer/{producers}p1c"));
        group.throughput(Throughput::Elements(BATCH));
        one::<Ring<u64>>(&mut group, producers);
        one::<ArrayQueue<u64>>(&mut group, producers);
        one::<Channel>(&mut group, producers);
        group.finish();
    }
}

fn bench_force_push_full(c: &mut Criterion) {
    let mut group = c.benchmark_group("force_push_full");
    group.throughput(Throughput::Elements(1));
    group.bench_function(BenchmarkId::from_parameter("powerhub::Ring"), |b| {
        let ring = Ring::new(CAPACITY);
        (0..CAPACITY as u64).for_each(|i| ring.push(i).unwrap());
        let mut i = 0u64;
        b.iter(|| {
            i += 1;
            black_box(ring.force_push(black_box(i)))
        });
    });
    group.bench_function(BenchmarkId::from_parameter("crossbeam::ArrayQueue"), |b| {
        let queue = ArrayQueue::new(CAPACITY);
        (0..CAPACITY as u64).for_each(|i| queue.push(i).unwrap());
        let mut i = 0u64;
        b.iter(|| {
            i += 1;
            black_box(queue.force_push(black_box(i)))
        });
    });
    group.finish();
}

fn bench_push_pop_uncontended(c: &mut Criterion) {
    let mut group = c.benchmark_group("push_pop_uncontended");
    group.throughput(Throughput::Elements(1));
    fn one<Q: Queue>(group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
        group.bench_function(BenchmarkId::from_parameter(Q::name()), |b| {
            let queue = Q::with_capacity(CAPACITY);
            let mut i = 0u64;
            b.iter(|| {
                i += 1;
                queue.try_push(black_box(i)).unwrap();
                black_box(queue.try_pop())
            });
        });
    }
    one::<Ring<u64>>(&mut group);
    one::<ArrayQueue<u64>>(&mut group);
    one::<Channel>(&mut group);
    group.finish();
}

/// Interleaved rounds of the transfer scenarios: each round runs every queue once, one after the
/// other, starting with a different queue each round; the median of the rounds is printed with
/// the ratio to `Ring`. On a shared, noisy machine the load drifts between criterion's
/// back-to-back groups; interleaving gives every queue the same drift. `Ring` runs twice per
/// round: the ratio of the two (an A/A control) shows the noise floor of the comparison.
fn interleaved_transfer() {
    const ROUNDS: usize = 12;
    const VALUES: u64 = 1_000_000;
    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }
    println!("interleaved transfer, queue of {CAPACITY}, {VALUES} values per run, median of {ROUNDS} rounds (Mvalues/s)");
    for producers in [1u64, 2] {
        let mut rates: [Vec<f64>; 4] = Default::default();
        for round in 0..ROUNDS {
            // Rotate which queue goes first: the first run of a round is measurably slower here
            // (two runs of the very same queue differed by up to 1.7x by position alone).
            for k in 0..4 {
                let which = (round + k) % 4;
                let run = match which {
                    0 | 3 => transfer::<Ring<u64>>(producers, VALUES),
                    1 => transfer::<ArrayQueue<u64>>(producers, VALUES),
                    _ => transfer::<Channel>(producers, VALUES),
                };
                rates[which].push(VALUES as f64 / run.as_secs_f64() / 1e6);
            }
        }
        let [ring, array_queue, channel, control] = rates.map(median);
        println!(
            "  {producers}p1c: {}: {ring:.1}  {}: {array_queue:.1} ({:.2}x of Ring)  \
             {}: {channel:.1} ({:.2}x of Ring)  A/A control, Ring again: {control:.1} ({:.2}x)",
            <Ring<u64> as Queue>::name(),
            <ArrayQueue<u64> as Queue>::name(),
            array_queue / ring,
            Channel::name(),
            channel / ring,
            control / ring,
        );
    }
}

criterion_group!(
    benches,
    bench_transfer,
    bench_force_push_full,
    bench_push_pop_uncontended
);

fn main() {
    // `POWERHUB_RING_INTERLEAVED=1 cargo bench -p powerhub --bench ring` prints the interleaved
    // comparison instead of running criterion.
    if std::env::var_os("POWERHUB_RING_INTERLEAVED").is_some() {
        interleaved_transfer();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
