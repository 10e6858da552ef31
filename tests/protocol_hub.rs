//! The push protocol over the real hub: a push subscription is a hub subscription (codec
//! `ndjson`) whose sink hands the shared batch frame to the connection's outbox. Every subscriber
//! of a topic reads the published bytes, identical, and a healthy NDJSON connection writes the
//! hub's one shared encode itself (same buffer).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use powerhub::hub::{Codec, Driver, Hub, HubOptions, PublishOptions, SubscribeOptions};
use powerhub::outbox::{Framing, Outbox, OutboxConfig, PayloadFactory};
use powerhub::plugin::{Completion, Frame, SendOutcome, Sink, SubscriberRef};
use powerhub::protocol::{reply, Action, Session, SessionConfig};

/// The `ndjson` plugin's framer, as the server uses it.
fn ndjson() -> powerhub_ndjson::NdjsonProtocol {
    powerhub_ndjson::NdjsonProtocol::new(1 << 20)
}

/// The connection's sink: records (connection, subscription id, frame) for the "shard" to hand to
/// the outbox.
#[derive(Debug, Default)]
struct ToShard {
    frames: Mutex<Vec<(usize, Arc<str>, Frame)>>,
}

struct Ctx {
    conn: usize,
    sub: Arc<str>,
}

impl Sink for ToShard {
    fn send(&self, sub: &SubscriberRef, frame: Frame, _done: Completion) -> SendOutcome {
        let ctx = sub
            .transport::<Ctx>()
            .expect("push subscriptions carry their context");
        self.frames
            .lock()
            .unwrap()
            .push((ctx.conn, Arc::clone(&ctx.sub), frame));
        SendOutcome::Accepted
    }
}

struct Conn {
    session: Session,
    outbox: Outbox,
    read: Vec<u8>,
    written: Vec<Bytes>,
}

struct Server {
    hub: Hub,
    sink: Arc<ToShard>,
    conns: Vec<Conn>,
    now: Instant,
}

impl Server {
    fn new(n: usize) -> Self {
        let now = Instant::now();
        let sink = Arc::new(ToShard::default());
        let hub = Hub::new(
            Arc::clone(&sink),
            HubOptions::default().driver(Driver::Manual),
        )
        .unwrap();
        let config = Arc::new(OutboxConfig {
            framing: Framing::Ndjson,
            ..OutboxConfig::default()
        });
        let conns = (0..n)
            .map(|i| Conn {
                session: Session::new(i as u64, SessionConfig::default()),
                outbox: Outbox::new(Arc::clone(&config), Arc::new(PayloadFactory), now).unwrap(),
                read: Vec::new(),
                written: Vec::new(),
            })
            .collect();
        Server {
            hub,
            sink,
            conns,
            now,
        }
    }

    fn line(&mut self, conn: usize, text: &str) {
        let now = self.now;
        let mut buf = text.as_bytes().to_vec();
        let action = self.conns[conn].session.handle_line(&mut buf);
        let c = &mut self.conns[conn];
        match action {
            Action::Subscribe {
                subscription_id,
                hub_id,
                topic,
                reply,
            } => {
                let ctx = Ctx {
                    conn,
                    sub: Arc::clone(&subscription_id),
                };
                let options = SubscribeOptions::default()
                    .id(hub_id.as_str())
                    .codec(Codec::Ndjson)
                    .sink(Arc::clone(&self.sink) as Arc<dyn Sink>)
                    .transport(Arc::new(ctx));
                self.hub.subscribe(&topic, |_| {}, options).unwrap();
                c.outbox.push_control(reply, now);
            }
            Action::Unsubscribe {
                subscription_id,
                hub_id,
                ack,
                ..
            } => {
                assert!(self.hub.unsubscribe(&hub_id));
                c.outbox.unsubscribe(&subscription_id, ack, now);
            }
            Action::Publish {
                request_id,
                topics,
                message,
                ..
            } => {
                let mut total = 0;
                for topic in &topics {
                    total += self
                        .hub
                        .publish(topic, message.clone(), PublishOptions::default())
                        .unwrap();
                }
                if request_id.is_some() {
                    c.outbox
                        .push_control(reply::published(request_id.as_ref(), total), now);
                }
            }
            Action::Reply(r) => c.outbox.push_control(r, now),
            Action::Pong => c.outbox.on_pong(now),
            other => panic!("{other:?}"),
        }
    }

    /// One hub turn, then every connection writes everything (healthy sockets).
    fn turn(&mut self) {
        let now = self.now;
        self.hub.turn(now);
        for (conn, sub, frame) in self.sink.frames.lock().unwrap().drain(..) {
            self.conns[conn].outbox.push_shared(&sub, frame, now);
        }
        for c in &mut self.conns {
            let mut out = Vec::new();
            let n = c.outbox.poll_transmit(&mut ndjson(), &mut out, now);
            for b in &out {
                c.read.extend_from_slice(b);
            }
            c.written.extend(out);
            c.outbox.on_written(n, now);
        }
    }

    fn read(&self, conn: usize) -> String {
        String::from_utf8(self.conns[conn].read.clone()).unwrap()
    }
}

#[test]
fn push_subscribers_of_a_topic_read_the_hubs_one_shared_encode() {
    let mut s = Server::new(4);
    s.line(0, r#"{"type":"subscribe","id":"a","stream":"obs"}"#);
    s.line(1, r#"{"type":"subscribe","id":"b","stream":"obs"}"#);
    s.line(
        2,
        r#"{"type":"subscribe","id":"c","stream":"obs","deviceId":"d1"}"#,
    );
    s.turn();
    let m1 = r#"{"type":"screenshot_update","stream":"obs","deviceId":"d1","deviceSessionUuid":null,"captureSequence":1, "png":"AAAA"}"#;
    let m2 = r#"{"type":"device_lifecycle","stream":"obs","deviceId":"d2","state":"online"}"#;
    s.line(3, &format!(r#"{{"type":"publish","id":1,"message":{m1}}}"#));
    s.line(3, &format!(r#"{{"type":"publish","id":2,"message":{m2}}}"#));
    s.turn();

    let all = format!("{m1}\n{m2}\n");
    assert_eq!(
        s.read(0),
        format!(
            "{}\n{all}",
            r#"{"type":"subscribed","requestId":"a","subscriptionId":"obs-1","stream":"obs"}"#
        )
    );
    assert_eq!(
        s.read(1),
        format!(
            "{}\n{all}",
            r#"{"type":"subscribed","requestId":"b","subscriptionId":"obs-1","stream":"obs"}"#
        )
    );
    assert_eq!(
        s.read(2),
        format!(
            "{}\n{m1}\n",
            r#"{"type":"subscribed","requestId":"c","subscriptionId":"obs-1","stream":"obs","deviceId":"d1"}"#
        )
    );
    assert_eq!(s.read(3), "{\"type\":\"published\",\"requestId\":1,\"delivered\":3}\n{\"type\":\"published\",\"requestId\":2,\"delivered\":2}\n");

    // The two all-device subscribers wrote the very same buffer: the hub's one encode of the batch.
    let batch0 = s.conns[0]
        .written
        .iter()
        .find(|b| b.len() == all.len())
        .expect("the batch frame as one segment");
    let batch1 = s.conns[1]
        .written
        .iter()
        .find(|b| b.len() == all.len())
        .expect("the batch frame as one segment");
    assert_eq!(batch0.as_ptr(), batch1.as_ptr());
    assert_eq!(
        s.hub.stats().encoded,
        2,
        "one encode for topic obs, one for obs/d1"
    );
}

#[test]
fn unsubscribed_push_subscription_receives_nothing_more() {
    let mut s = Server::new(2);
    s.line(
        0,
        r#"{"type":"subscribe","id":"a","stream":"obs","subscriptionId":"x"}"#,
    );
    s.turn();
    s.line(0, r#"{"type":"unsubscribe","id":"u","subscriptionId":"x"}"#);
    s.line(
        1,
        r#"{"type":"publish","id":"p","message":{"type":"t","stream":"obs"}}"#,
    );
    s.turn();
    assert_eq!(
        s.read(0),
        "{\"type\":\"subscribed\",\"requestId\":\"a\",\"subscriptionId\":\"x\",\"stream\":\"obs\"}\n{\"type\":\"unsubscribed\",\"requestId\":\"u\",\"subscriptionId\":\"x\"}\n"
    );
    assert_eq!(
        s.read(1),
        "{\"type\":\"published\",\"requestId\":\"p\",\"delivered\":0}\n"
    );
}
