//! The push session of one connection on a shard: client commands in (through the sans-IO
//! [`protocol::Session`]), hub subscriptions and replies out (through the connection's
//! [`Outbox`](crate::outbox::Outbox)).
//!
//! A push subscription is a hub subscription whose sink is the connection's [`ConnSink`]: the
//! sink runs on the thread that drives the hub (shard 0 for the engine's own hub, or the hub's
//! drain thread), so it never touches the connection. It hands the shared
//! frame to the owning shard through the shard's lock-free queue (and a wake-up), and answers
//! `Pending` when the connection's backlog is over `limits.backpressure_bytes`; the shard completes
//! that send once the backlog is back under the mark, so the hub holds further messages in the
//! subscription's bounded queue, under its slow-consumer policy.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use powerhub_plugin::codes;
use powerhub_plugin::{
    CloseReason, Completion, Frame, SendError, SendOutcome, Sink, SubscriberRef,
};

use super::close::Ending;
use super::config::SlowConsumerChoice;
use super::shard::{Conn, ConnShared, ShardHandle, ShardMsg};
use super::Shared;
use crate::hub::{Codec, PublishOptions, SlowConsumer, SubscribeOptions};
use crate::protocol::{reply, Action, Command, RequestId};

/// The sink of every push subscription of one connection.
#[derive(Debug)]
pub(crate) struct ConnSink {
    pub(crate) shard: Arc<ShardHandle>,
    pub(crate) conn: Arc<ConnShared>,
    pub(crate) backpressure: usize,
}

impl ConnSink {
    fn subscription_id(sub: &SubscriberRef) -> Arc<str> {
        sub.transport::<Arc<str>>()
            .cloned()
            .unwrap_or_else(|| Arc::clone(sub.id_arc()))
    }
}

impl Sink for ConnSink {
    fn send(&self, sub: &SubscriberRef, frame: Frame, done: Completion) -> SendOutcome {
        if self.conn.closed.load(Ordering::Relaxed) {
            return SendOutcome::Failed(SendError::Closed);
        }
        let queued = self.conn.in_queue.fetch_add(frame.len(), Ordering::Relaxed) + frame.len();
        let over = self.conn.backlog.load(Ordering::Relaxed) + queued > self.backpressure;
        let sub = Self::subscription_id(sub);
        let (key, shared) = (self.conn.key, Arc::clone(&self.conn));
        if over {
            self.shard.send(ShardMsg::Deliver {
                conn: key,
                sub,
                frame,
                done: Some(done),
                shared,
            });
            SendOutcome::Pending
        } else {
            self.shard.send(ShardMsg::Deliver {
                conn: key,
                sub,
                frame,
                done: None,
                shared,
            });
            SendOutcome::Accepted
        }
    }

    fn close(&self, sub: &SubscriberRef, reason: CloseReason) {
        if reason == CloseReason::Unsubscribe || self.conn.closed.load(Ordering::Relaxed) {
            return;
        }
        self.shard.send(ShardMsg::SubClosed {
            conn: self.conn.key,
            sub: Self::subscription_id(sub),
            reason,
        });
    }
}

/// A limit error: the push protocol's `error` (code `limit_exceeded`) answering `request_id`,
/// plus a `limit` field naming the config key:
/// `{"type":"error","requestId":..,"code":"limit_exceeded","message":..,"limit":"<key>"}`.
pub(crate) fn limit_error(request_id: Option<&RequestId>, limit: &str, message: &str) -> Bytes {
    reply::error_with_limit(request_id, codes::LIMIT_EXCEEDED, message, Some(limit))
}

fn slow_consumer(choice: SlowConsumerChoice) -> SlowConsumer {
    match choice {
        SlowConsumerChoice::DropOldest => SlowConsumer::DropOldest,
        SlowConsumerChoice::DropNewest => SlowConsumer::DropNewest,
        SlowConsumerChoice::Disconnect => SlowConsumer::Disconnect,
    }
}

/// What the shard must do after a command.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum After {
    /// Carry on.
    Continue,
    /// Write what is queued, then close, saying why as the ending says.
    Close(Ending),
}

/// Handles one inbound JSON message (an NDJSON line, a frame's element, a WebSocket text).
pub(crate) fn on_text(conn: &mut Conn, shared: &Shared, line: Bytes, now: Instant) -> After {
    // A usual publish is read where it lies (the line may share one receive with others); any
    // other line is parsed in place, copied first only if its bytes are shared.
    let cmd = match conn.session.parse(line) {
        Ok(cmd) => cmd,
        Err(e) => {
            conn.outbox.push_control(e.to_reply(), now);
            return After::Continue;
        }
    };
    let limit = shared.config.limits.max_subscriptions_per_connection;
    if matches!(cmd, Command::Subscribe { .. }) && conn.session.subscriptions().count() >= limit {
        shared.counters.limit_errors.fetch_add(1, Ordering::Relaxed);
        let msg = format!("a connection may hold at most max_subscriptions_per_connection = {limit} subscriptions");
        // In order after the replies already queued (the shard queues it), then the close.
        return After::Close(
            Ending::limit("max_subscriptions_per_connection", msg)
                .answering(cmd.request_id())
                .in_order(),
        );
    }
    let request_id = cmd.request_id().cloned();
    match conn.session.handle_command(cmd) {
        Action::Subscribe {
            subscription_id,
            hub_id,
            topic,
            reply,
        } => {
            let s = &shared.config.subscriptions;
            let options = SubscribeOptions::default()
                .id(hub_id.as_str())
                .sink(Arc::clone(&conn.sink))
                .codec(if conn.hub_frames {
                    Codec::Json
                } else {
                    Codec::Ndjson
                })
                .max_queue(s.max_queue)
                .max_batch(s.max_batch)
                .slow_consumer(slow_consumer(s.slow_consumer))
                .transport(Arc::new(Arc::clone(&subscription_id)));
            // The reply is queued before the hub can deliver anything: deliveries reach this
            // shard through its queue, which is drained after this call returns.
            match shared.hub.subscribe_sink(&topic, options) {
                Ok(_handle) => {
                    shared
                        .counters
                        .subscriptions
                        .fetch_add(1, Ordering::Relaxed);
                    conn.outbox.push_control(reply, now);
                }
                Err(e) => {
                    let err = conn.session.subscribe_failed(
                        &subscription_id,
                        request_id.as_ref(),
                        &e.to_string(),
                    );
                    conn.outbox.push_control(err, now);
                }
            }
        }
        Action::Unsubscribe {
            subscription_id,
            hub_id,
            ack,
        } => {
            if shared.hub.unsubscribe(&hub_id) {
                shared
                    .counters
                    .subscriptions
                    .fetch_sub(1, Ordering::Relaxed);
            }
            conn.outbox.unsubscribe(&subscription_id, ack, now);
        }
        Action::Publish {
            request_id,
            topics,
            message,
            ..
        } => {
            let mut total = 0;
            let mut failure = None;
            for topic in &topics {
                match shared
                    .hub
                    .publish(topic, message.clone(), PublishOptions::default())
                {
                    Ok(n) => total += n,
                    Err(e) => failure = Some(e),
                }
            }
            match failure {
                // No id, no acknowledgement: the publisher cannot correlate one (docs/protocol.md).
                None if request_id.is_none() => {}
                None => conn
                    .outbox
                    .push_control(reply::published(request_id.as_ref(), total), now),
                Some(e) => conn.outbox.push_control(
                    reply::error(request_id.as_ref(), codes::PUBLISH_FAILED, &e.to_string()),
                    now,
                ),
            }
        }
        Action::Reply(bytes) => conn.outbox.push_control(bytes, now),
        Action::Pong => conn.outbox.on_pong(now),
    }
    After::Continue
}

/// The hub closed subscription `sub` (slow consumer under `disconnect`, or the hub closed).
pub(crate) fn on_sub_closed(
    conn: &mut Conn,
    shared: &Shared,
    sub: &str,
    reason: CloseReason,
) -> After {
    if conn.session.subscription(sub).is_none() {
        return After::Continue;
    }
    // Forget it in the session; the hub already dropped it, and the acknowledgement is not sent.
    let _ = conn.session.handle_command(Command::Unsubscribe {
        id: None,
        subscription_id: sub.to_owned(),
    });
    shared
        .counters
        .subscriptions
        .fetch_sub(1, Ordering::Relaxed);
    After::Close(match reason {
        CloseReason::SlowConsumer => Ending::slow_consumer(format!(
            "subscription {sub} fell behind under slow_consumer = \"disconnect\""
        )),
        _ => Ending::hub_closed(format!("the hub closed subscription {sub}: {reason}")),
    })
}

/// Unsubscribes every subscription of a closing connection.
pub(crate) fn release(conn: &mut Conn, shared: &Shared) {
    for (_, info) in conn.session.close() {
        if shared.hub.unsubscribe(&info.hub_id) {
            shared
                .counters
                .subscriptions
                .fetch_sub(1, Ordering::Relaxed);
        }
    }
}
