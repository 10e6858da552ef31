//! A thread-per-core service with blocking receivers: each worker thread owns one receiver and
//! blocks in `recv`; the publisher thread fans a stream out to them through the topic's
//! `Publisher`. One worker is slow and sees its losses as `Lagged`, which do not slow the
//! others. Prints each worker's count, then exits.
//!
//! Run: `cargo run --example thread_receivers`

use std::thread;
use std::time::Duration;

use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, RecvError, SubscribeOptions};
use powerhub::transport::SpySink;

const WORKERS: usize = 4;
const MESSAGES: u64 = 50_000;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let hub = Hub::new(SpySink::new(), HubOptions::default())?;
    let mut workers = Vec::new();
    for w in 0..WORKERS {
        let slow = w == WORKERS - 1;
        let queue = if slow { 256 } else { 65_536 };
        let mut rx = hub.receiver("ticks", SubscribeOptions::default().max_queue(queue))?;
        workers.push(thread::spawn(move || {
            let (mut received, mut missed, mut last) = (0u64, 0u64, None);
            loop {
                match rx.recv() {
                    Ok(m) => {
                        received += 1;
                        last = Some(m.topic_seq());
                        if slow && received % 64 == 0 {
                            thread::sleep(Duration::from_millis(1));
                        }
                    }
                    Err(RecvError::Lagged { missed: n }) => missed += n,
                    Err(RecvError::Closed { reason }) => {
                        return format!(
                            "worker {w}{}: {received} received, {missed} missed, last topic_seq {last:?}, closed ({reason})",
                            if slow { " (slow)" } else { "" }
                        );
                    }
                    Err(e) => return format!("worker {w}: {e}"),
                }
            }
        }));
    }
    // The topic's handle: the topic is looked up once, as a channel's sender.
    let ticks = hub.publisher("ticks");
    for n in 0..MESSAGES {
        let m = Message::json(format!("{{\"type\":\"tick\",\"n\":{n}}}"))?;
        ticks.publish(m, PublishOptions::default())?;
    }
    hub.flush_timeout(Duration::from_secs(10)).ok();
    thread::sleep(Duration::from_millis(50));
    hub.shutdown()?;
    for w in workers {
        println!("{}", w.join().map_err(|_| "a worker panicked")?);
    }
    Ok(())
}
