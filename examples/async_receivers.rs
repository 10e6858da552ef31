//! A tokio service that consumes the hub with async receivers: one task per subscriber, each
//! awaiting `recv_async`, one of them slow (it sleeps between receives, lags, and says how much
//! it missed). The hub needs no runtime of its own; the receivers are woken through the tasks'
//! wakers. Prints what each task received, then exits.
//!
//! Run: `cargo run --example async_receivers`

use std::time::Duration;

use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, RecvError, SubscribeOptions};
use powerhub::transport::SpySink;

const MESSAGES: u64 = 2_000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let hub = Hub::new(SpySink::new(), HubOptions::default())?;
    let mut tasks = Vec::new();
    for (name, queue, pause) in [
        ("fast", 4_096, None),
        ("slow", 64, Some(Duration::from_millis(1))),
    ] {
        let mut rx = hub.receiver("prices", SubscribeOptions::default().max_queue(queue))?;
        tasks.push(tokio::spawn(async move {
            let (mut received, mut missed) = (0u64, 0u64);
            loop {
                match rx.recv_async().await {
                    Ok(_) => received += 1,
                    Err(RecvError::Lagged { missed: n }) => missed += n,
                    Err(RecvError::Closed { reason }) => {
                        return format!(
                            "{name}: {received} received, {missed} missed, closed ({reason})"
                        );
                    }
                    Err(e) => return format!("{name}: {e}"),
                }
                if let Some(p) = pause {
                    tokio::time::sleep(p).await;
                }
            }
        }));
    }
    for n in 0..MESSAGES {
        let m = Message::json(format!("{{\"type\":\"price\",\"n\":{n}}}"))?;
        hub.publish("prices", m, PublishOptions::default())?;
        if n % 100 == 0 {
            tokio::task::yield_now().await;
        }
    }
    // Let the fast one catch up, then close: every task ends with Closed.
    hub.flush_async().await.ok();
    tokio::time::sleep(Duration::from_millis(50)).await;
    hub.shutdown_async().await?;
    for t in tasks {
        println!("{}", t.await?);
    }
    Ok(())
}
