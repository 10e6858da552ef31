//! The push protocol: client commands and server messages, newline-delimited JSON.
//!
//! - [`parse_command`] parses one inbound line into a typed [`Command`] (a usual `publish` in one
//!   validating pass, everything else with the full iterative reader);
//!   bad input is a [`CommandError`] that names the problem and carries the request id.
//! - [`reply`] builds the server's messages (`subscribed`, `unsubscribed`, `published`, `pong`,
//!   `ping`, `error`).
//! - [`Session`] is the sans-IO state of one connection: it turns lines into [`Action`]s
//!   (subscribe to a hub topic, publish, push a reply), so the runtime only does IO.
//!
//! Topics: a subscription to every device of stream `S` is a hub subscription to topic `S`; a
//! subscription to device `D` of `S` is one to topic `S/D`. A published message is published to
//! `S` and, when it has a string `deviceId` `D`, to `S/D`; in each topic the hub encodes it once
//! and every subscriber reads the same bytes. See the protocol reference (`docs/protocol.md`).

mod command;
pub(crate) mod fast;
#[doc(hidden)]
pub mod fuzzing;
mod json;
mod rate;
pub mod reply;
pub(crate) mod scan;
mod session;

pub use command::{
    parse_command, Command, CommandError, CommandParser, Credential, ErrorKind, PublishMeta,
    RequestId, DEFAULT_MAX_JSON_DEPTH, ERROR_CODES, LIMIT_EXCEEDED, MAX_ECHO_BYTES, MAX_NAME_BYTES,
};
pub use rate::{PublishLimiter, RateLimited, UserRate};
pub(crate) use session::topic_parts;
pub use session::{
    device_topic, publish_topics, stream_topic, Action, AuthPolicy, Session, SessionConfig,
    SubscriptionInfo, UserCounts, RESERVED_MESSAGE_TYPES,
};
