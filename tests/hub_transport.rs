//! The built-in transports: the in-process channel (iterator and async stream, bounded with
//! real back-pressure) and the spy.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use futures_core::Stream;
use powerhub::hub::{Driver, Hub, HubOptions, Message, PublishOptions, SubscribeOptions};
use powerhub::transport::{channel, ChannelEvent, SpyMode, SpySink, TryRecvError};
use powerhub_plugin::frame;
use powerhub_plugin::{
    CloseReason, Completion, Frame, SendError, SendOutcome, Sink, SubscriberRef,
};

fn frame_messages(ev: &ChannelEvent) -> Vec<String> {
    match ev {
        ChannelEvent::Frame { frame, .. } => frame::decode(frame)
            .unwrap()
            .json_messages()
            .unwrap()
            .iter()
            .map(|m| String::from_utf8(m.to_vec()).unwrap())
            .collect(),
        other => panic!("expected a frame, got {other:?}"),
    }
}

#[test]
fn channel_iterator_receives_frames_then_close_events_and_ends() {
    let (sink, rx) = channel(8);
    let hub = Hub::new(sink, HubOptions::default().driver(Driver::Manual)).unwrap();
    hub.subscribe("t", |_| {}, SubscribeOptions::default().id("a"))
        .unwrap()
        .detach();
    hub.publish_json("t", &1).unwrap();
    hub.publish_json("t", &2).unwrap();
    hub.flush().unwrap();
    drop(hub);
    let events: Vec<ChannelEvent> = rx.collect();
    assert_eq!(events.len(), 2);
    assert_eq!(frame_messages(&events[0]), ["1", "2"]);
    assert!(
        matches!(&events[1], ChannelEvent::Closed { subscriber, reason: CloseReason::HubClosed } if subscriber.id() == "a")
    );
}

/// A `Subscription` handle kept past the hub's close does not keep the channel open: the
/// hub lets its subscribers (and their sinks) go, so a `for event in rx` consumer ends after
/// the close events, whoever still holds a handle. The handle then says it is not active and
/// that there is nothing left to unsubscribe.
#[test]
fn a_kept_subscription_handle_does_not_keep_the_channel_open_after_the_hub_closed() {
    for threaded in [false, true] {
        let (sink, rx) = channel(8);
        let driver = if threaded {
            Driver::Thread
        } else {
            Driver::Manual
        };
        let hub = Hub::new(sink, HubOptions::default().driver(driver)).unwrap();
        let kept = hub
            .subscribe("t", |_| {}, SubscribeOptions::default().id("a"))
            .unwrap();
        hub.publish_json("t", &1).unwrap();
        hub.flush().unwrap();
        drop(hub);
        // Read with a deadline: a channel held open fails the test rather than hanging it.
        let mut events = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match rx.recv_timeout(Duration::from_millis(50)) {
                Ok(event) => events.push(event),
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => assert!(
                    std::time::Instant::now() < deadline,
                    "the channel is still open after the hub's close: {events:?}"
                ),
            }
        }
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(frame_messages(&events[0]), ["1"]);
        assert!(
            matches!(&events[1], ChannelEvent::Closed { reason, .. } if *reason == CloseReason::HubClosed),
            "{events:?}"
        );
        assert_eq!((kept.id(), kept.topic()), ("a", "t"));
        assert!(!kept.is_active());
        assert!(!kept.unsubscribe());
    }
}

#[test]
fn channel_reports_pending_when_full_and_completes_when_the_consumer_catches_up() {
    let (sink, rx) = channel(1);
    let sub = SubscriberRef::new("a", "t");
    let done = Arc::new(std::sync::Mutex::new(Vec::new()));
    let completion = |tag: u32| {
        let d = Arc::clone(&done);
        Completion::new(move |r| d.lock().unwrap().push((tag, r)))
    };
    assert_eq!(
        sink.send(&sub, Frame::from_static(b"1"), completion(1)),
        SendOutcome::Accepted
    );
    assert_eq!(
        sink.send(&sub, Frame::from_static(b"2"), completion(2)),
        SendOutcome::Pending
    );
    assert_eq!(rx.len(), 2);
    // Only the accepted send's (ignored) completion has run: it was dropped unused.
    assert_eq!(
        done.lock().unwrap().iter().filter(|(t, _)| *t == 2).count(),
        0
    );
    let first = rx.try_recv().unwrap();
    assert!(matches!(first, ChannelEvent::Frame { ref frame, .. } if &frame[..] == b"1"));
    assert!(
        done.lock().unwrap().contains(&(2, Ok(()))),
        "room was made: the parked send completed"
    );
    let second = rx.try_recv().unwrap();
    assert!(matches!(second, ChannelEvent::Frame { ref frame, .. } if &frame[..] == b"2"));
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Empty);
    drop(sink);
    assert_eq!(rx.try_recv().unwrap_err(), TryRecvError::Disconnected);
}

#[test]
fn channel_back_pressure_holds_the_hub_to_one_frame_in_flight() {
    let (sink, rx) = channel(1);
    let hub = Hub::new(sink, HubOptions::default().driver(Driver::Manual)).unwrap();
    hub.subscribe(
        "t",
        |_| {},
        SubscribeOptions::default()
            .id("a")
            .max_batch(1)
            .max_queue(4),
    )
    .unwrap()
    .detach();
    for i in 0..4 {
        hub.publish(
            "t",
            Message::to_json(&i).unwrap(),
            PublishOptions::default(),
        )
        .unwrap();
    }
    hub.turn(std::time::Instant::now());
    // Frame 0 is accepted, frame 1 parks (Pending): the hub stops there.
    assert_eq!(rx.len(), 2);
    assert!(hub.stats().list[0].in_flight);
    assert_eq!(hub.stats().list[0].queued, 2);
    // The consumer reads one: the parked send completes and the hub may go on.
    assert_eq!(frame_messages(&rx.try_recv().unwrap()), ["0"]);
    assert!(!hub.stats().list[0].in_flight);
    hub.turn(std::time::Instant::now());
    let mut got = Vec::new();
    while got.len() < 3 {
        got.extend(frame_messages(&rx.try_recv().unwrap()));
        hub.turn(std::time::Instant::now());
    }
    assert_eq!(got, ["1", "2", "3"]);
}

#[test]
fn dropping_the_receiver_fails_sends_and_parked_sends() {
    let (sink, rx) = channel(1);
    let sub = SubscriberRef::new("a", "t");
    let result = Arc::new(std::sync::Mutex::new(None));
    let r = Arc::clone(&result);
    assert_eq!(
        sink.send(&sub, Frame::from_static(b"1"), Completion::noop()),
        SendOutcome::Accepted
    );
    assert_eq!(
        sink.send(
            &sub,
            Frame::from_static(b"2"),
            Completion::new(move |x| *r.lock().unwrap() = Some(x))
        ),
        SendOutcome::Pending
    );
    drop(rx);
    assert_eq!(*result.lock().unwrap(), Some(Err(SendError::Closed)));
    assert_eq!(
        sink.send(&sub, Frame::from_static(b"3"), Completion::noop()),
        SendOutcome::Failed(SendError::Closed)
    );
}

struct Flag(std::sync::atomic::AtomicBool);
impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn channel_stream_is_pending_until_a_frame_arrives_and_ends_with_the_senders() {
    let (sink, mut rx) = channel(4);
    let flag = Arc::new(Flag(false.into()));
    let waker = Waker::from(Arc::clone(&flag));
    let mut cx = Context::from_waker(&waker);
    assert!(Pin::new(&mut rx).poll_next(&mut cx).is_pending());
    let sub = SubscriberRef::new("a", "t");
    sink.send(&sub, Frame::from_static(b"x"), Completion::noop());
    assert!(
        flag.0.load(std::sync::atomic::Ordering::SeqCst),
        "the send woke the stream"
    );
    match Pin::new(&mut rx).poll_next(&mut cx) {
        Poll::Ready(Some(ChannelEvent::Frame { frame, .. })) => assert_eq!(&frame[..], b"x"),
        other => panic!("{other:?}"),
    }
    drop(sink);
    assert!(matches!(
        Pin::new(&mut rx).poll_next(&mut cx),
        Poll::Ready(None)
    ));
}

#[test]
fn channel_stream_under_tokio_receives_what_a_threaded_hub_sends() {
    let (sink, rx) = channel(2);
    let hub = Hub::new(sink, HubOptions::default()).unwrap();
    hub.subscribe(
        "t",
        |_| {},
        SubscribeOptions::default()
            .id("a")
            .max_queue(1000)
            .max_batch(5),
    )
    .unwrap()
    .detach();
    let publisher = std::thread::spawn(move || {
        for i in 0..100 {
            hub.publish_json("t", &i).unwrap();
        }
        hub.shutdown().unwrap();
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let got = rt.block_on(async move {
        use futures_util::StreamExt;
        let mut rx = rx;
        let mut got = Vec::new();
        // Bounded so a bug cannot hang the suite; no timing is asserted.
        while let Ok(Some(ev)) =
            tokio::time::timeout(Duration::from_secs(30), StreamExt::next(&mut rx)).await
        {
            if let ChannelEvent::Frame { .. } = ev {
                got.extend(frame_messages(&ev));
            }
        }
        got
    });
    publisher.join().unwrap();
    let want: Vec<String> = (0..100).map(|i: i32| i.to_string()).collect();
    assert_eq!(
        got, want,
        "every message, in order, through real back-pressure"
    );
}

#[test]
fn spy_records_fails_pends_and_panics_on_demand() {
    let spy = SpySink::new();
    let a = SubscriberRef::new("a", "t");
    assert_eq!(
        spy.send(&a, Frame::from_static(b"1"), Completion::noop()),
        SendOutcome::Accepted
    );
    spy.set_mode(SpyMode::Fail("nope".into()));
    assert_eq!(
        spy.send(&a, Frame::from_static(b"2"), Completion::noop()),
        SendOutcome::Failed(SendError::Refused("nope".into()))
    );
    spy.set_mode(SpyMode::Pending);
    let seen = Arc::new(std::sync::Mutex::new(None));
    let s = Arc::clone(&seen);
    assert_eq!(
        spy.send(
            &a,
            Frame::from_static(b"3"),
            Completion::new(move |r| *s.lock().unwrap() = Some(r))
        ),
        SendOutcome::Pending
    );
    assert!(spy.complete_next(Err(SendError::Closed)));
    assert_eq!(*seen.lock().unwrap(), Some(Err(SendError::Closed)));
    spy.set_mode_for("a", SpyMode::Panic);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        spy.send(&a, Frame::from_static(b"4"), Completion::noop())
    }));
    assert!(r.is_err());
    assert_eq!(spy.sends(), 4);
    assert_eq!(spy.frames().len(), 2);
    spy.close(&a, CloseReason::Unsubscribe);
    assert_eq!(
        spy.closes(),
        vec![("a".to_owned(), CloseReason::Unsubscribe)]
    );
}

/// A timeout too long for the clock to hold (`Duration::MAX`) is a wait without a deadline, not
/// a panic, in every bounded wait of the public API.
#[test]
fn a_timeout_too_long_for_the_clock_waits_without_panicking() {
    let (sink, rx) = channel(8);
    let hub = Hub::new(sink, HubOptions::default()).unwrap();
    hub.subscribe("t", |_| {}, SubscribeOptions::default().id("a"))
        .unwrap()
        .detach();
    let mut receiver = hub.receiver("t", SubscribeOptions::default()).unwrap();
    hub.publish_json("t", &1).unwrap();
    assert_eq!(hub.flush_timeout(Duration::MAX), Ok(()));
    let event = rx.recv_timeout(Duration::MAX).unwrap();
    assert_eq!(frame_messages(&event), ["1"]);
    let m = receiver.recv_timeout(Duration::MAX).unwrap();
    assert_eq!(m.message().bytes().as_ref(), b"1");
    assert_eq!(hub.shutdown_timeout(Duration::MAX), Ok(()));
    assert!(hub.is_closed());
}
