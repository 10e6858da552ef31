//! A quick loopback benchmark of the engine: one in-process publisher, N NDJSON subscribers over
//! TCP loopback, on each IO backend. Reports deliveries/s and end-to-end latency percentiles
//! (publish call to the subscriber's read, HDR histogram). The full comparison with peers is the
//! perf tool's job; this is the engine's own smoke figure.
//!
//! Run: `cargo run --release --example loopback_bench -- [--subscribers 100] [--seconds 5]
//!       [--payload 64] [--shards 2] [--rate 0] [--backend both|io_uring|epoll]`
//!
//! `--rate 0` publishes as fast as the subscribers keep up (the publisher waits when the average
//! subscriber is more than a window behind, so no policy drops); `--rate R` publishes R messages
//! per second open-loop, latency measured from each message's scheduled send time.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use powerhub::hub::{Message, PublishOptions};
use powerhub::runtime::{
    BackendChoice, Config, Engine, ListenAddr, ListenerConfig, ProtocolRegistry,
};

struct Args {
    subscribers: usize,
    seconds: u64,
    payload: usize,
    shards: usize,
    rate: u64,
    backends: Vec<BackendChoice>,
}

fn parse_args() -> Args {
    let mut a = Args {
        subscribers: 100,
        seconds: 5,
        payload: 64,
        shards: 2,
        rate: 0,
        backends: vec![BackendChoice::IoUring, BackendChoice::Epoll],
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < argv.len() {
        let v = &argv[i + 1];
        match argv[i].as_str() {
            "--subscribers" => a.subscribers = v.parse().expect("--subscribers N"),
            "--seconds" => a.seconds = v.parse().expect("--seconds N"),
            "--payload" => a.payload = v.parse().expect("--payload BYTES"),
            "--shards" => a.shards = v.parse().expect("--shards N"),
            "--rate" => a.rate = v.parse().expect("--rate MSGS_PER_S"),
            "--backend" => {
                a.backends = match v.as_str() {
                    "both" => vec![BackendChoice::IoUring, BackendChoice::Epoll],
                    other => vec![other.parse().expect("--backend both|io_uring|epoll")],
                }
            }
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    a
}

/// The value of `"t":` in a line (nanoseconds since the run's base instant).
fn field_t(line: &[u8]) -> Option<u64> {
    let pos = line.windows(4).position(|w| w == b"\"t\":")?;
    let digits = &line[pos + 4..];
    let mut v = 0u64;
    let mut any = false;
    for &b in digits {
        if !b.is_ascii_digit() {
            break;
        }
        v = v * 10 + u64::from(b - b'0');
        any = true;
    }
    any.then_some(v)
}

fn run(args: &Args, backend: BackendChoice) {
    let mut config = Config::default();
    config.engine.backend = backend;
    config.engine.shards = args.shards;
    config.subscriptions.max_queue = 8192;
    config.limits.max_connections = args.subscribers + 16;
    config
        .listeners
        .push(ListenerConfig::tcp("ndjson", "127.0.0.1:0"));
    let engine = Engine::start(config, &ProtocolRegistry::with_builtins()).expect("engine starts");
    let ListenAddr::Tcp(addr) = engine.listeners()[0].addr.clone() else {
        unreachable!()
    };
    let base = Instant::now();
    let warmup = Duration::from_secs(1);
    let measure = Duration::from_secs(args.seconds);
    let received = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut readers = Vec::new();
    for _ in 0..args.subscribers {
        let mut s = TcpStream::connect(addr).expect("connect");
        s.write_all(b"{\"type\":\"subscribe\",\"stream\":\"bench\"}\n")
            .unwrap();
        let mut r = BufReader::with_capacity(256 << 10, s.try_clone().unwrap());
        let mut line = Vec::new();
        r.read_until(b'\n', &mut line).unwrap();
        assert!(
            line.starts_with(b"{\"type\":\"subscribed\""),
            "{}",
            String::from_utf8_lossy(&line)
        );
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let (received, stop) = (Arc::clone(&received), Arc::clone(&stop));
        readers.push(std::thread::spawn(move || {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).unwrap();
            let mut line = Vec::with_capacity(256);
            let mut counted = 0u64;
            while !stop.load(Ordering::Relaxed) {
                line.clear();
                match r.read_until(b'\n', &mut line) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(_) => continue,
                }
                let Some(t) = field_t(&line) else { continue };
                received.fetch_add(1, Ordering::Relaxed);
                if t >= warmup.as_nanos() as u64 && t < (warmup + measure).as_nanos() as u64 {
                    let now = base.elapsed().as_nanos() as u64;
                    let _ = hist.record(now.saturating_sub(t).max(1));
                    counted += 1;
                }
            }
            drop(s);
            (hist, counted)
        }));
    }
    let pad = "x".repeat(args.payload.saturating_sub(60));
    let hub = engine.hub().clone();
    let n = args.subscribers as u64;
    let window = 1024u64;
    let mut seq = 0u64;
    let end = warmup + measure;
    let started = Instant::now();
    loop {
        let elapsed = base.elapsed();
        if elapsed >= end {
            break;
        }
        let t = if let Some(per_s) = std::num::NonZeroU64::new(args.rate) {
            let scheduled = Duration::from_nanos(seq * 1_000_000_000 / per_s);
            if scheduled >= end {
                break;
            }
            // Sleep rather than spin: on a small machine a spinning publisher starves the shards.
            let now = base.elapsed();
            if scheduled > now + Duration::from_micros(100) {
                std::thread::sleep(scheduled - now);
            }
            scheduled.as_nanos() as u64
        } else {
            while seq * n > received.load(Ordering::Relaxed) + window * n && base.elapsed() < end {
                std::thread::sleep(Duration::from_micros(50));
            }
            base.elapsed().as_nanos() as u64
        };
        let m = format!(r#"{{"type":"tick","stream":"bench","seq":{seq},"t":{t},"p":"{pad}"}}"#);
        hub.publish(
            "bench",
            Message::json(m).unwrap(),
            PublishOptions::default(),
        )
        .unwrap();
        seq += 1;
    }
    let publish_time = started.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    let stats = engine.stats();
    let hub_stats = engine.hub().stats();
    drop(engine);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 10_000_000_000, 3).unwrap();
    let mut counted = 0;
    for r in readers {
        let (h, c) = r.join().unwrap();
        hist.add(&h).unwrap();
        counted += c;
    }
    let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "backend={:<8} subscribers={} payload={}B rate={} published={} in {:.1}s | deliveries/s={:.0} | latency us p50={:.0} p99={:.0} p99.9={:.0} max={:.0} | hub dropped={} sends={} bytes_out={}",
        format!("{backend:?}"),
        args.subscribers,
        args.payload,
        if args.rate == 0 { "max".to_string() } else { args.rate.to_string() },
        seq,
        publish_time.as_secs_f64(),
        counted as f64 / measure.as_secs_f64(),
        us(0.5),
        us(0.99),
        us(0.999),
        hist.max() as f64 / 1000.0,
        hub_stats.dropped,
        stats.sends,
        stats.bytes_out,
    );
}

fn main() {
    let args = parse_args();
    for &backend in &args.backends {
        run(&args, backend);
    }
}
