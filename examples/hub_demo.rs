//! The hub at work: a publisher fans prices out to fast in-process consumers, one stalled
//! consumer (drop-oldest) and one that gets cut loose (disconnect). The demo prints what each
//! received and the hub's stats, then exits.
//!
//! Run: `cargo run --example hub_demo`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;

use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, SlowConsumer, SubscribeOptions};
use powerhub::transport::{channel, ChannelEvent};
use powerhub_plugin::frame;

const FAST: usize = 4;
const MESSAGES: u64 = 20_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Fast consumers read the hub's channel transport on their own thread.
    let (sink, frames) = channel(1024);
    let hub = Hub::new(
        sink,
        HubOptions::default()
            .on_error(|err, sub| eprintln!("hub error ({:?}): {err}", sub.map(|s| s.id()))),
    )?;

    let handled = Arc::new(AtomicU64::new(0));
    for i in 0..FAST {
        let handled = Arc::clone(&handled);
        hub.subscribe(
            "prices",
            move |_| {
                handled.fetch_add(1, Ordering::Relaxed);
            },
            SubscribeOptions::default()
                .id(format!("fast-{i}"))
                .max_queue(4096),
        )?
        .detach();
    }

    // A stalled consumer: its own channel, never read. It keeps the newest 64 messages and
    // drops the rest; the publisher never waits for it.
    let (stalled_sink, stalled_rx) = channel(1);
    hub.subscribe(
        "prices",
        |_| {},
        SubscribeOptions::default()
            .id("stalled")
            .sink(Arc::new(stalled_sink)),
    )?
    .detach();
    // A consumer for which stale data is worse than none: cut loose once it falls behind.
    let (strict_sink, strict_rx) = channel(1);
    hub.subscribe(
        "prices",
        |_| {},
        SubscribeOptions::default()
            .id("strict")
            .max_queue(16)
            .slow_consumer(SlowConsumer::Disconnect)
            .sink(Arc::new(strict_sink)),
    )?
    .detach();

    let reader = thread::spawn(move || {
        let (mut frames_seen, mut messages, mut bytes) = (0u64, 0u64, 0u64);
        for event in frames {
            if let ChannelEvent::Frame { frame: f, .. } = event {
                frames_seen += 1;
                bytes += f.len() as u64;
                messages += u64::from(frame::decode(&f).map(|d| d.count()).unwrap_or(0));
            }
        }
        (frames_seen, messages, bytes)
    });

    // Two publishers on their own threads; the last price of each is retained.
    let publishers: Vec<_> = (0..2)
        .map(|p| {
            let hub = hub.clone();
            thread::spawn(move || {
                for n in 0..MESSAGES / 2 {
                    let retain = n == MESSAGES / 2 - 1;
                    let msg = Message::to_json(&serde_json::json!({ "publisher": p, "n": n }))
                        .expect("serializable");
                    hub.publish("prices", msg, PublishOptions::default().retain(retain))
                        .expect("valid publish");
                    if n % 500 == 499 {
                        // A realistic feed comes in bursts, not in one tight loop.
                        thread::sleep(std::time::Duration::from_millis(2));
                    }
                }
            })
        })
        .collect();
    for p in publishers {
        p.join().expect("publisher thread");
    }

    // A late subscriber gets the retained log replayed.
    let late = Arc::new(AtomicU64::new(0));
    let l = Arc::clone(&late);
    hub.subscribe(
        "prices",
        move |_| {
            l.fetch_add(1, Ordering::Relaxed);
        },
        SubscribeOptions::default().id("late"),
    )?
    .detach();

    // The stalled consumer's one in-flight frame would hold `flush` forever: let it go.
    hub.unsubscribe("stalled");
    hub.flush()?;
    let stats = hub.stats();
    println!("published     {}", stats.published);
    println!("delivered     {}", stats.delivered);
    println!("dropped       {}", stats.dropped);
    println!("disconnected  {}", stats.disconnected);
    println!(
        "encoded       {} frames (shared by every subscriber with the same batch)",
        stats.encoded
    );
    println!("bytes_out     {}", stats.bytes_out);
    println!(
        "handled by the fast handlers: {}",
        handled.load(Ordering::Relaxed)
    );
    println!(
        "replayed to the late subscriber: {}",
        late.load(Ordering::Relaxed)
    );
    for s in &stats.list {
        println!(
            "  {:<8} queued {:>4}  dropped {:>6}  bytes_sent {:>9}  in_flight {}",
            s.id, s.queued, s.dropped, s.bytes_sent, s.in_flight
        );
    }
    hub.shutdown()?;
    drop(hub);
    let (frames_seen, messages, bytes) = reader.join().expect("reader thread");
    println!("channel reader: {frames_seen} frames, {messages} messages, {bytes} bytes");
    drop((stalled_rx, strict_rx));
    Ok(())
}
