//! The push session of one connection on a shard: client commands in (through the sans-IO
//! [`protocol::Session`]), hub subscriptions and replies out (through the connection's
//! [`Outbox`](crate::outbox::Outbox)).
//!
//! A push subscription is not a hub subscriber: the shard adds it to its own fan-out of the
//! topic (see [`super::fanout`]), which hands each batch's shared frame straight to the
//! connection's outbox, the subscription's only queue. So a subscribe or an unsubscribe is
//! returned to the shard ([`After::Subscribe`], [`After::Unsubscribe`]), which owns the fan-out.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use bytes::Bytes;
use powerhub_plugin::codes;

use super::close::Ending;
use super::shard::Conn;
use super::Shared;
use crate::hub::PublishOptions;
use crate::protocol::{reply, Action, Command, RequestId};
use crate::security::tls::PeerSubject;

/// A limit error: the push protocol's `error` (code `limit_exceeded`) answering `request_id`,
/// plus a `limit` field naming the config key:
/// `{"type":"error","requestId":..,"code":"limit_exceeded","message":..,"limit":"<key>"}`.
pub(crate) fn limit_error(request_id: Option<&RequestId>, limit: &str, message: &str) -> Bytes {
    reply::error_with_limit(request_id, codes::LIMIT_EXCEEDED, message, Some(limit))
}

/// What the shard must do after a command.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum After {
    /// Carry on.
    Continue,
    /// Write what is queued, then close, saying why as the ending says.
    Close(Ending),
    /// Add the subscription to the shard's fan-out of `topic` (after delivering what the topic
    /// holds for the connection's other subscriptions), then queue `reply`.
    Subscribe {
        subscription_id: Arc<str>,
        hub_id: Arc<str>,
        topic: String,
        reply: Bytes,
        request_id: Option<RequestId>,
    },
    /// Deliver what the topic holds, remove the subscription from the shard's fan-out, then
    /// [`Outbox::unsubscribe`](crate::outbox::Outbox::unsubscribe) with `ack`.
    Unsubscribe {
        subscription_id: Arc<str>,
        topic: String,
        ack: Bytes,
    },
}

/// Handles one inbound JSON message (an NDJSON line, a frame's element, a WebSocket text).
/// `now` and `wall` are the receive's time (one clock read per receive, not per command: the
/// commands of one receive arrived together).
pub(crate) fn on_text(
    conn: &mut Conn,
    shared: &Shared,
    line: Bytes,
    now: Instant,
    wall: SystemTime,
) -> After {
    // A usual publish is read where it lies (the line may share one receive with others); any
    // other line is parsed in place, copied first only if its bytes are shared.
    let cmd = match conn.session.parse(line) {
        Ok(cmd) => cmd,
        Err(e) => {
            conn.outbox.push_control(e.to_reply(), now);
            return After::Continue;
        }
    };
    let request_id = cmd.request_id().cloned();
    let action = conn.session.handle_command_at(cmd, wall);
    perform(conn, shared, action, request_id, now)
}

/// Handles a credential the protocol's handshake carried, as an `auth` command without an id.
pub(crate) fn on_credential(conn: &mut Conn, shared: &Shared, token: &str, now: Instant) -> After {
    let action = conn.session.authenticate(token, SystemTime::now());
    perform(conn, shared, action, None, now)
}

/// Handles the client certificate the TLS handshake verified: a subject listed in
/// `[[auth.certificates]]` authenticates the connection (see
/// [`Session::authenticate_certificate`](crate::protocol::Session::authenticate_certificate)).
pub(crate) fn on_certificate(
    conn: &mut Conn,
    shared: &Shared,
    subject: &PeerSubject,
    now: Instant,
) -> After {
    match conn.session.authenticate_certificate(subject) {
        Some(action) => perform(conn, shared, action, None, now),
        None => After::Continue,
    }
}

/// Does what the session asked for one command (`request_id` is the command's).
fn perform(
    conn: &mut Conn,
    shared: &Shared,
    action: Action,
    request_id: Option<RequestId>,
    now: Instant,
) -> After {
    match action {
        Action::Subscribe {
            subscription_id,
            hub_id,
            topic,
            reply,
        } => {
            return After::Subscribe {
                subscription_id,
                hub_id: hub_id.into(),
                topic,
                reply,
                request_id,
            }
        }
        Action::Unsubscribe {
            subscription_id,
            topic,
            ack,
            ..
        } => {
            return After::Unsubscribe {
                subscription_id,
                topic,
                ack,
            }
        }
        Action::Publish {
            request_id,
            topics,
            message,
            ..
        } => {
            let mut total = 0;
            let mut failure = None;
            conn.published = true;
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
        Action::CloseOnAuth {
            request_id,
            code,
            message,
        } => {
            return After::Close(
                Ending::auth(code, message)
                    .answering(request_id.as_ref())
                    .in_order(),
            );
        }
        Action::CloseOnLimit {
            request_id,
            limit,
            message,
        } => {
            shared
                .counters_of(conn.key.shard as usize)
                .limit_errors
                .fetch_add(1, Ordering::Relaxed);
            // In order after the replies already queued (the shard queues it), then the close.
            return After::Close(
                Ending::limit(limit, message)
                    .answering(request_id.as_ref())
                    .in_order(),
            );
        }
    }
    After::Continue
}

/// Forgets subscription `sub`, which the hub's close ended (the shard's fan-out dropped it
/// already), and returns the connection's ending.
pub(crate) fn sub_ended(conn: &mut Conn, sub: &str) -> Ending {
    // No acknowledgement is sent.
    let _ = conn.session.handle_command(Command::Unsubscribe {
        id: None,
        subscription_id: sub.to_owned(),
    });
    Ending::hub_closed(format!("the hub closed subscription {sub}"))
}
