//! Property tests of receivers against a plain model of a drop-oldest queue (the eager one of
//! realtime-hub.md: a publish into a full queue discards its oldest message): whatever the
//! interleaving of publishes and receives, a receiver receives exactly the messages the model
//! still holds, reports exactly what the model dropped since the last receive as one `Lagged`,
//! in order, and ends with the newest messages.

use powerhub::hub::{Hub, HubOptions, Message, PublishOptions, SubscribeOptions, TryRecvError};
use powerhub::transport::SpySink;
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Publish(usize),
    Receive(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            (1usize..150).prop_map(Op::Publish),
            (1usize..150).prop_map(Op::Receive),
        ],
        1..40,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn a_drop_oldest_receiver_reports_exactly_what_it_lost(cap in 1usize..200, ops in ops()) {
        let hub = Hub::new(SpySink::new(), HubOptions::default()).unwrap();
        let mut rx = hub.receiver("t", SubscribeOptions::default().max_queue(cap)).unwrap();
        let mut published = 0u64;
        // The model: the next topic number the receiver should see, given what it was told.
        let mut next = 0u64;
        let mut lost = 0u64;
        let mut shown_dropped = 0u64;
        let step = |rx: &mut powerhub::hub::Receiver, next: &mut u64, lost: &mut u64, published: u64| -> bool {
            match rx.try_recv() {
                Ok(m) => {
                    assert_eq!(m.topic_seq(), *next, "in order, gaps only where reported");
                    // The eager queue: it holds the newest `cap`; an older message was dropped.
                    assert!(published - *next <= cap as u64, "{} received past the bound", *next);
                    *next += 1;
                    true
                }
                Err(TryRecvError::Lagged { missed }) => {
                    // Exactly what the eager queue dropped since the last receive.
                    assert_eq!(missed, published - *next - cap as u64, "the loss as the model has it");
                    *next += missed;
                    *lost += missed;
                    true
                }
                Err(TryRecvError::Empty) => {
                    assert_eq!(*next, published, "empty only when everything was seen");
                    false
                }
                Err(e) => panic!("{e}"),
            }
        };
        for op in ops {
            match op {
                Op::Publish(k) => {
                    for _ in 0..k {
                        hub.publish("t", Message::json(published.to_string()).unwrap(), PublishOptions::default()).unwrap();
                        published += 1;
                    }
                }
                Op::Receive(k) => {
                    for _ in 0..k {
                        if !step(&mut rx, &mut next, &mut lost, published) {
                            break;
                        }
                    }
                }
            }
            let s = hub.stats();
            prop_assert!(s.list[0].queued <= cap);
            // A counter to alert on: it never goes back.
            prop_assert!(s.dropped >= shown_dropped, "dropped went from {} to {}", shown_dropped, s.dropped);
            shown_dropped = s.dropped;
        }
        while step(&mut rx, &mut next, &mut lost, published) {}
        prop_assert_eq!(next, published);
        prop_assert_eq!(hub.stats().list[0].dropped, lost);
        prop_assert_eq!(hub.stats().dropped, lost);
        prop_assert_eq!(hub.stats().delivered, published - lost);
    }
}
