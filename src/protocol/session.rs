//! A sans-IO push session: turns a connection's inbound lines into actions for the runtime.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use super::command::{
    echo, Command, CommandError, CommandParser, ErrorKind, PublishMeta, RequestId, MAX_NAME_BYTES,
};
use super::fast;
use super::rate::{PublishLimiter, UserRate};
use super::reply;
use crate::hub::Message;
use crate::security::auth::{Authenticator, Identity};
use crate::security::permissions::{self, Decision, PermissionDenied, Permissions, PublishCache};
use crate::security::tls::PeerSubject;

/// The `type`s of the server's own messages. While authentication is on, a published message of
/// one of these types is refused (`reserved_type`) unless `[auth] allow_reply_types` is set, so
/// that a subscriber can trust that an `error` or a `frames_dropped` came from the server.
pub const RESERVED_MESSAGE_TYPES: &[&str] = &[
    "error",
    "subscribed",
    "unsubscribed",
    "published",
    "pong",
    "ping",
    "frames_dropped",
    "authenticated",
];

/// How a session authenticates its connection: the verifier of tokens and the rule for
/// published messages typed like server replies. Shared by every connection of a server.
#[derive(Debug, Clone)]
pub struct AuthPolicy {
    /// Verifies presented tokens.
    pub authenticator: Arc<Authenticator>,
    /// `[auth] allow_reply_types`: a published message may have a [`RESERVED_MESSAGE_TYPES`]
    /// type.
    pub allow_reply_types: bool,
    /// `[auth] max_connections_per_user` (0: no limit).
    pub max_connections_per_user: usize,
    /// `[auth] max_subscriptions_per_user` (0: no limit).
    pub max_subscriptions_per_user: usize,
    /// `[auth] publish_messages_per_second_per_user` (0: no limit): one bucket per user,
    /// shared by its connections.
    pub publish_messages_per_second_per_user: u64,
    /// `[auth] publish_bytes_per_second_per_user` (0: no limit).
    pub publish_bytes_per_second_per_user: u64,
    /// The counts those limits are checked against, shared by the server's sessions.
    pub users: Arc<UserCounts>,
}

impl AuthPolicy {
    /// A policy verifying with `authenticator`, with no per-user limits and reply types refused.
    pub fn new(authenticator: Arc<Authenticator>) -> AuthPolicy {
        AuthPolicy {
            authenticator,
            allow_reply_types: false,
            max_connections_per_user: 0,
            max_subscriptions_per_user: 0,
            publish_messages_per_second_per_user: 0,
            publish_bytes_per_second_per_user: 0,
            users: Arc::default(),
        }
    }

    /// The per-user limits for a user whose identity sets none of its own: connections and
    /// subscriptions (0: no limit).
    fn user_limits(&self) -> (usize, usize) {
        (
            self.max_connections_per_user,
            self.max_subscriptions_per_user,
        )
    }
}

/// The authentication state of a session whose server requires it.
#[derive(Debug)]
struct AuthState {
    policy: AuthPolicy,
    /// Who the connection is, once a token verified.
    identity: Option<Identity>,
    /// The publish decisions of the identity's permissions (cleared with a fresh token).
    cache: PublishCache,
    /// The connection counts in its user's connections ([`UserCounts`]).
    counted: bool,
    /// Subscriptions counted in its user's subscriptions.
    subscriptions: usize,
    /// The user's publish rate limits, shared by its connections (`None`: none configured).
    rate: Option<Arc<UserRate>>,
}

impl Drop for AuthState {
    fn drop(&mut self) {
        self.release();
    }
}

impl AuthState {
    /// Gives back the connection's place in its user's counts (the connection and its
    /// subscriptions), once.
    fn release(&mut self) {
        if let (true, Some(identity)) = (self.counted, &self.identity) {
            self.policy
                .users
                .release(&identity.user, self.subscriptions);
        }
        self.counted = false;
        self.subscriptions = 0;
    }

    /// Makes `identity` the connection's (a first one counts the connection in its user's;
    /// a later one must be the same user's), answering request `id` with `authenticated`.
    fn accept(
        &mut self,
        id: Option<RequestId>,
        identity: Identity,
    ) -> Result<Action, CommandError> {
        if let Some(current) = &self.identity {
            if current.user != identity.user {
                let kind = ErrorKind::UserMismatch {
                    current: echo(&current.user),
                    presented: echo(&identity.user),
                };
                return Err(CommandError::new(id, kind));
            }
        }
        let expires = identity
            .expires_at
            .map(|t| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()));
        if !self.counted {
            let (max, _) = identity.limits.or(self.policy.user_limits());
            let rates = identity.publish_rates.or((
                self.policy.publish_messages_per_second_per_user,
                self.policy.publish_bytes_per_second_per_user,
            ));
            let Some(rate) = self.policy.users.add_connection(&identity.user, max, rates) else {
                let user = echo(&identity.user);
                let whose = limit_source(identity.limits.max_connections, "max_connections");
                let message = format!(
                    "user `{user}` holds its maximum of max_connections_per_user = {max} connections{whose}"
                );
                return Ok(Action::CloseOnLimit {
                    request_id: id,
                    limit: "max_connections_per_user",
                    message,
                });
            };
            self.counted = true;
            self.rate = (!rate.is_unlimited()).then_some(rate);
        }
        let reply = reply::authenticated(id.as_ref(), &identity.user, expires);
        self.identity = Some(identity);
        self.cache.clear();
        Ok(Action::Reply(reply))
    }
}

/// What a session has beyond the common case (boxed: a connection of a server without
/// authentication or rate limits pays 8 bytes for it).
#[derive(Debug)]
struct Extra {
    auth: Option<AuthState>,
    limiter: PublishLimiter,
    /// Publishes refused in a row by the limiter.
    strikes: u32,
    /// The last second (Unix time) of the client certificate's validity, its `notAfter`, on a
    /// mutual-TLS connection.
    certificate_until: Option<u64>,
}

impl Extra {
    fn new(limiter: PublishLimiter) -> Extra {
        Extra {
            auth: None,
            limiter,
            strikes: 0,
            certificate_until: None,
        }
    }
}

/// Where a per-user limit in an error message came from: the user's own (`key` in its entry's
/// `limits`, or its token's `limits` claim) or the `[auth]` default (nothing said).
fn limit_source(own: Option<usize>, key: &str) -> String {
    own.map_or_else(String::new, |_| format!(" (the user's own limits.{key})"))
}

/// Connections and subscriptions per user, across the server's connections (for
/// `[auth] max_connections_per_user` and `max_subscriptions_per_user`).
#[derive(Debug, Default)]
pub struct UserCounts {
    counts: parking_lot::Mutex<UserMap>,
}

/// The users' entries, and when entries without a connection were last looked over.
#[derive(Debug, Default)]
struct UserMap {
    users: std::collections::HashMap<String, UserEntry>,
    swept: Option<SystemTime>,
}

/// How often entries of users without a connection, whose publish budget has refilled, are
/// removed (when a connection is counted): their budget refills within about a second of their
/// last publish.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// One user's connections and subscriptions, and its publish rate limits, while it has a
/// connection or its rate limits still hold something it published (a user that reconnects
/// finds its budget as it left it, not refilled).
#[derive(Debug)]
struct UserEntry {
    connections: usize,
    subscriptions: usize,
    rate: Arc<UserRate>,
}

impl UserCounts {
    /// Counts a connection of `user`, unless it has `max` already (0: no limit), and gives the
    /// user's rate limits (made with `rates`, messages and bytes per second, by its first
    /// connection).
    fn add_connection(&self, user: &str, max: usize, rates: (u64, u64)) -> Option<Arc<UserRate>> {
        let now = SystemTime::now();
        let mut map = self.counts.lock();
        if map
            .swept
            .is_none_or(|at| now.duration_since(at).is_ok_and(|d| d >= SWEEP_EVERY))
        {
            map.swept = Some(now);
            map.users
                .retain(|_, e| e.connections > 0 || !e.rate.is_full(now));
        }
        let entry = map
            .users
            .entry(user.to_owned())
            .or_insert_with(|| UserEntry {
                connections: 0,
                subscriptions: 0,
                rate: Arc::new(UserRate::new(rates.0, rates.1)),
            });
        if max > 0 && entry.connections >= max {
            if entry.connections == 0 && entry.rate.is_full(now) {
                map.users.remove(user);
            }
            return None;
        }
        entry.connections += 1;
        Some(Arc::clone(&entry.rate))
    }

    /// Counts a subscription of `user`, unless it has `max` already (0: no limit).
    fn add_subscription(&self, user: &str, max: usize) -> bool {
        let mut map = self.counts.lock();
        let Some(entry) = map.users.get_mut(user) else {
            return false;
        };
        if max > 0 && entry.subscriptions >= max {
            return false;
        }
        entry.subscriptions += 1;
        true
    }

    fn remove_subscription(&self, user: &str) {
        if let Some(entry) = self.counts.lock().users.get_mut(user) {
            entry.subscriptions = entry.subscriptions.saturating_sub(1);
        }
    }

    /// A connection of `user` holding `subscriptions` counted ones ends. The user's entry goes
    /// with its last connection unless its rate limits still hold what it published: then it
    /// stays, so a reconnect does not refill them, until a later sweep finds them full.
    fn release(&self, user: &str, subscriptions: usize) {
        let mut map = self.counts.lock();
        if let Some(entry) = map.users.get_mut(user) {
            entry.connections = entry.connections.saturating_sub(1);
            entry.subscriptions = entry.subscriptions.saturating_sub(subscriptions);
            if entry.connections == 0 && entry.rate.is_full(SystemTime::now()) {
                map.users.remove(user);
            }
        }
    }

    /// `user`'s open connections and subscriptions.
    pub fn of(&self, user: &str) -> (usize, usize) {
        self.counts
            .lock()
            .users
            .get(user)
            .map_or((0, 0), |e| (e.connections, e.subscriptions))
    }
}

/// Limits of one push session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Longest command line accepted, in bytes (without newline). A longer line gets a
    /// `limit_exceeded` error (`"limit":"max_message_bytes"`) and the connection stays usable. Set the stream protocol's framing
    /// limit (`ProtocolLimits::max_message_bytes`) above it: only a line over the framing limit
    /// closes the connection. Default: 8 MiB (a 2 MiB screenshot, base64-encoded, fits).
    pub max_line_bytes: usize,
    /// Most subscriptions one connection may hold. Default: 256.
    pub max_subscriptions: usize,
    /// Deepest nesting of arrays and objects in a command line (the command object is depth
    /// 1). A deeper line gets a `limit_exceeded` error (`"limit":"max_json_depth"`) and the connection stays usable. Default: 128
    /// ([`DEFAULT_MAX_JSON_DEPTH`](super::DEFAULT_MAX_JSON_DEPTH)).
    pub max_json_depth: usize,
    /// Publishes per second one connection may make (a token bucket holding one second's
    /// worth); past it a publish is refused with a `limit_exceeded` error
    /// (`"limit":"publish_messages_per_second"`). 0 (the default): no limit.
    pub publish_messages_per_second: u64,
    /// Published message bytes per second one connection may make, as above
    /// (`"limit":"publish_bytes_per_second"`). 0 (the default): no limit.
    pub publish_bytes_per_second: u64,
    /// Refused publishes in a row after which the connection is closed (the limit error names
    /// the rate limit); 0 (the default): never closed for it.
    pub publish_violations_before_close: u32,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            max_line_bytes: 8 << 20,
            max_subscriptions: 256,
            max_json_depth: super::command::DEFAULT_MAX_JSON_DEPTH,
            publish_messages_per_second: 0,
            publish_bytes_per_second: 0,
            publish_violations_before_close: 0,
        }
    }
}

/// One subscription of a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriptionInfo {
    /// The stream.
    pub stream: String,
    /// The device, or `None` for all devices of the stream.
    pub device_id: Option<String>,
    /// The hub topic: [`stream_topic`] or [`device_topic`].
    pub topic: String,
    /// The hub subscriber id: unique across connections (`c<connection>/<subscriptionId>`).
    pub hub_id: String,
}

/// What the runtime must do for one inbound line. Replies are JSON messages for
/// [`Outbox::push_control`](crate::outbox::Outbox::push_control).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Action {
    /// Subscribe in the hub to `topic` with subscriber id `hub_id`, the sink being this
    /// connection's outbox, deliveries pushed under `subscription_id`; then push `reply`
    /// (before any delivery of the subscription). If the hub refuses, call
    /// [`Session::subscribe_failed`] and push its error instead.
    Subscribe {
        /// The subscription id the client sees (in `frames_dropped`, in `unsubscribe`).
        subscription_id: Arc<str>,
        /// The hub subscriber id.
        hub_id: String,
        /// The hub topic.
        topic: String,
        /// The `subscribed` reply.
        reply: Bytes,
    },
    /// Unsubscribe `hub_id` in the hub, then call
    /// [`Outbox::unsubscribe`](crate::outbox::Outbox::unsubscribe)`(subscription_id, ack)`.
    Unsubscribe {
        /// The subscription id the client sees.
        subscription_id: Arc<str>,
        /// The hub subscriber id.
        hub_id: String,
        /// The hub topic.
        topic: String,
        /// The `unsubscribed` acknowledgement.
        ack: Bytes,
    },
    /// Publish `message` (verbatim) to every topic of `topics`, add up the subscriber counts,
    /// and, when the command carried an id, push [`reply::published`]`(request_id, total)` (a
    /// publish without an id gets no reply unless it fails). The message is a JSON
    /// [`Message`](crate::hub::Message) already: the command parser validated it, and the hub
    /// does not parse it again.
    Publish {
        /// The command's correlation id, for the reply.
        request_id: Option<RequestId>,
        /// The stream topic, then the device topic when the message has a `deviceId` string.
        topics: Vec<String>,
        /// The message, byte for byte as the publisher wrote it.
        message: Message,
        /// What the message says about itself.
        meta: PublishMeta,
    },
    /// Push this reply (a `pong`, or an error reply: the connection stays usable).
    Reply(Bytes),
    /// An inbound `pong`: call [`Outbox::on_pong`](crate::outbox::Outbox::on_pong).
    Pong,
    /// The command passed a limit whose rule is to close (a `subscribe` beyond
    /// [`SessionConfig::max_subscriptions`]): push the limit error (code `limit_exceeded`,
    /// `limit` naming the key, answering `request_id`) after what is queued, then close.
    CloseOnLimit {
        /// The command's correlation id, for the error.
        request_id: Option<RequestId>,
        /// The config key of the limit.
        limit: &'static str,
        /// The error's message.
        message: String,
    },
    /// A connection that has not authenticated presented a token that was refused: push the
    /// error (code `code`, answering `request_id`) after what is queued, then close (WebSocket:
    /// 1008). A refused *fresh* token on an authenticated connection is an [`Action::Reply`]
    /// instead: the connection keeps its identity until that expires.
    CloseOnAuth {
        /// The command's correlation id, for the error.
        request_id: Option<RequestId>,
        /// The error code ([`AuthError::code`](crate::security::auth::AuthError::code)).
        code: &'static str,
        /// The error's message.
        message: String,
    },
}

/// The hub topic of every device of `stream`: the stream name itself.
pub fn stream_topic(stream: &str) -> String {
    topic_parts(stream, None).concat()
}

/// The hub topic of one device of `stream`: `stream/deviceId` (stream names contain no `/`).
pub fn device_topic(stream: &str, device_id: &str) -> String {
    topic_parts(stream, Some(device_id)).concat()
}

/// The parts whose concatenation is the topic of `device` of `stream`, or of every device of
/// `stream` when `device` is `None`: the one statement of the topic names, for those who write
/// them into a buffer of their own (the push connection's topic list).
pub(crate) fn topic_parts<'a>(stream: &'a str, device: Option<&'a str>) -> [&'a str; 3] {
    match device {
        Some(device) => [stream, "/", device],
        None => [stream, "", ""],
    }
}

/// What the publish checks read of a message: borrowed from a command's [`PublishMeta`] or
/// from the line itself (the fast path).
#[derive(Clone, Copy)]
struct PublishedBy<'a> {
    stream: &'a str,
    kind: &'a str,
    /// `message.deviceId` when it is a string.
    device_id: Option<&'a str>,
}

impl<'a> PublishedBy<'a> {
    fn meta(meta: &'a PublishMeta) -> Self {
        PublishedBy {
            stream: &meta.stream,
            kind: &meta.kind,
            device_id: meta.device_id.as_str(),
        }
    }
}

/// The topics a message is published to: its stream's topic, and its device's topic when
/// `deviceId` is a string.
pub fn publish_topics(meta: &PublishMeta) -> Vec<String> {
    let mut topics = vec![stream_topic(&meta.stream)];
    if let Some(device) = meta.device_id.as_str() {
        topics.push(device_topic(&meta.stream, device));
    }
    topics
}

/// The push protocol state of one connection: its subscriptions and limits. No IO: the runtime
/// feeds it lines and performs the [`Action`]s.
///
/// ```
/// use powerhub::protocol::{Action, Session, SessionConfig};
///
/// let mut session = Session::new(7, SessionConfig::default());
/// let mut line = br#"{"type":"subscribe","id":"r1","stream":"obs","deviceId":"d1"}"#.to_vec();
/// match session.handle_line(&mut line) {
///     Action::Subscribe { subscription_id, hub_id, topic, reply } => {
///         assert_eq!(&*subscription_id, "obs-1");
///         assert_eq!(hub_id, "c7/obs-1");
///         assert_eq!(topic, "obs/d1");
///         assert_eq!(&reply[..], br#"{"type":"subscribed","requestId":"r1","subscriptionId":"obs-1","stream":"obs","deviceId":"d1"}"#);
///     }
///     other => panic!("{other:?}"),
/// }
/// ```
#[derive(Debug)]
pub struct Session {
    /// Shared by every connection of a server (8 bytes per connection, not 24).
    config: Arc<SessionConfig>,
    connection_id: u64,
    /// A connection holds few subscriptions (most often one): a vector sized to what is held is
    /// far smaller than a hash map's first allocation, and a scan of it is as fast.
    subscriptions: SubList,
    next_id: u64,
    /// Authentication and rate limits, where the server has them. Without authentication every
    /// subscription and every publish but to `$` streams is permitted
    /// ([`Permissions::unrestricted`]).
    extra: Option<Box<Extra>>,
}

impl Session {
    /// A session for connection `connection_id` (unique within the server; it makes hub ids
    /// unique), on a server without authentication.
    pub fn new(connection_id: u64, config: SessionConfig) -> Self {
        Session::with_shared_config(connection_id, Arc::new(config))
    }

    /// [`Session::new`] with limits shared by many sessions (a server's connections).
    pub fn with_shared_config(connection_id: u64, config: Arc<SessionConfig>) -> Self {
        let limiter = PublishLimiter::new(
            config.publish_messages_per_second,
            config.publish_bytes_per_second,
        );
        let extra = (!limiter.is_unlimited()).then(|| Box::new(Extra::new(limiter)));
        Session {
            config,
            connection_id,
            subscriptions: SubList::default(),
            next_id: 1,
            extra,
        }
    }

    /// The session's extras, made (without rate limits) where it had none.
    fn extra_mut(&mut self) -> &mut Extra {
        self.extra
            .get_or_insert_with(|| Box::new(Extra::new(PublishLimiter::new(0, 0))))
    }

    fn auth(&self) -> Option<&AuthState> {
        self.extra.as_ref()?.auth.as_ref()
    }

    fn auth_mut(&mut self) -> Option<&mut AuthState> {
        self.extra.as_mut()?.auth.as_mut()
    }

    /// The same session on a server that requires authentication: until a token verifies,
    /// only `auth`, `ping` and `pong` are accepted (anything else gets `auth_required`); then
    /// every subscribe and publish is checked against the user's permissions.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::SystemTime;
    /// use powerhub::protocol::{Action, AuthPolicy, Session, SessionConfig};
    /// use powerhub::security::auth::{AuthConfig, Authenticator};
    ///
    /// let config: AuthConfig = toml::from_str(r#"
    ///     [[tokens]]
    ///     token = "reader-token"
    ///     user = "reader"
    ///     permissions = { subscribe = { allow = ["obs/*"] } }
    /// "#).unwrap();
    /// let policy = AuthPolicy::new(Arc::new(Authenticator::from_config(&config).unwrap()));
    /// let mut s = Session::new(1, SessionConfig::default()).with_auth(policy);
    /// let now = SystemTime::now();
    /// let mut run = |s: &mut Session, line: &str| s.handle_line_at(&mut line.as_bytes().to_vec(), now);
    ///
    /// let Action::Reply(r) = run(&mut s, r#"{"type":"subscribe","id":1,"stream":"obs","deviceId":"d1"}"#) else { panic!() };
    /// assert!(std::str::from_utf8(&r).unwrap().contains(r#""code":"auth_required""#));
    ///
    /// let Action::Reply(r) = run(&mut s, r#"{"type":"auth","id":2,"token":"reader-token"}"#) else { panic!() };
    /// assert_eq!(&r[..], br#"{"type":"authenticated","requestId":2,"user":"reader","expiresAt":null}"#);
    ///
    /// assert!(matches!(run(&mut s, r#"{"type":"subscribe","id":3,"stream":"obs","deviceId":"d1"}"#), Action::Subscribe { .. }));
    /// let Action::Reply(r) = run(&mut s, r#"{"type":"subscribe","id":4,"stream":"other"}"#) else { panic!() };
    /// assert!(std::str::from_utf8(&r).unwrap().contains(r#""code":"permission_denied""#));
    /// ```
    #[must_use]
    pub fn with_auth(mut self, policy: AuthPolicy) -> Self {
        let auth = AuthState {
            policy,
            identity: None,
            cache: PublishCache::new(),
            counted: false,
            subscriptions: 0,
            rate: None,
        };
        self.extra_mut().auth = Some(auth);
        self
    }

    /// Whether the server requires authentication and the connection has not authenticated.
    pub fn awaiting_auth(&self) -> bool {
        self.auth().is_some_and(|a| a.identity.is_none())
    }

    /// The authenticated user, if any.
    pub fn user(&self) -> Option<&str> {
        self.auth()
            .and_then(|a| a.identity.as_ref())
            .map(|i| i.user.as_str())
    }

    /// Bounds the connection's life by its client certificate, valid through the Unix second
    /// `not_after` (see [`certificate_until`](Self::certificate_until)).
    pub(crate) fn limit_to_certificate(&mut self, not_after: u64) {
        self.extra_mut().certificate_until = Some(not_after);
    }

    /// The last second (Unix time) of the connection's client certificate's validity, its
    /// `notAfter`: the connection is to be closed with `certificate_expired` past it. `None`
    /// without a client certificate.
    #[inline]
    pub(crate) fn certificate_until(&self) -> Option<u64> {
        self.extra.as_ref()?.certificate_until
    }

    /// When the connection's token expires (it is to be closed then with `token_expired`,
    /// unless a fresh token arrived): `None` without authentication, before it, and for tokens
    /// that never expire.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.auth()?.identity.as_ref()?.expires_at
    }

    /// Handles a token presented outside a command (in the WebSocket handshake), as an `auth`
    /// command without an id.
    pub fn authenticate(&mut self, token: &str, now: SystemTime) -> Action {
        match self.auth_command(None, token, now) {
            Ok(action) => action,
            Err(e) => Action::Reply(e.to_reply()),
        }
    }

    /// Handles the client certificate the TLS handshake verified (on a listener with
    /// `tls_client_ca`): when the server requires authentication, the connection has not
    /// authenticated yet and `subject` is listed in `[[auth.certificates]]`, the connection is
    /// that entry's user from now on, and the returned action says so (`authenticated`, as for
    /// a token in the handshake). `None` otherwise: the client authenticates with a token.
    pub fn authenticate_certificate(&mut self, subject: &PeerSubject) -> Option<Action> {
        let auth = self.auth_mut()?;
        if auth.identity.is_some() {
            return None;
        }
        let identity = auth.policy.authenticator.verify_certificate(subject)?;
        Some(match auth.accept(None, identity) {
            Ok(action) => action,
            Err(e) => Action::Reply(e.to_reply()),
        })
    }

    /// Handles one inbound line (without newline). Never fails: bad input becomes an
    /// [`Action::Reply`] with an error naming the problem and the request id.
    pub fn handle_line(&mut self, line: &mut [u8]) -> Action {
        self.handle_line_at(line, SystemTime::now())
    }

    /// [`Session::handle_line`] at wall-clock time `now` (token expiry is judged against it).
    pub fn handle_line_at(&mut self, line: &mut [u8], now: SystemTime) -> Action {
        if let Some(e) = self.line_too_long(line) {
            return Action::Reply(e.to_reply());
        }
        match self.parser().parse(line) {
            Ok(cmd) => self.handle_command_at(cmd, now),
            Err(e) => Action::Reply(self.before_auth(line, e).to_reply()),
        }
    }

    /// The error for a line longer than [`SessionConfig::max_line_bytes`] (`limit_exceeded`,
    /// naming `max_message_bytes`, with the line's id where one can be read), if it is one.
    #[inline]
    pub(crate) fn line_too_long(&self, line: &[u8]) -> Option<CommandError> {
        if line.len() <= self.config.max_line_bytes {
            return None;
        }
        let id = super::command::best_effort_id(line);
        let kind = ErrorKind::LineTooLong {
            size: line.len(),
            limit: self.config.max_line_bytes,
        };
        Some(CommandError::new(id, kind))
    }

    /// Parses one line under the session's limits, reading it where it lies: see
    /// [`CommandParser::parse_shared`]. No length check (the framing enforced it). Before the
    /// connection authenticated (where the server requires it), a `subscribe`, `unsubscribe`
    /// or `publish` is refused with `auth_required` whatever its fields hold.
    pub fn parse(&mut self, line: Bytes) -> Result<Command, CommandError> {
        self.parser()
            .parse_bytes(&line)
            .map_err(|e| self.before_auth(&line, e))
    }

    /// The error for a line that does not parse: before the connection authenticated, a
    /// command that needs authentication gets `auth_required` rather than what is wrong with
    /// its fields (as it does when they are right); a line that is no command (not JSON, no
    /// known `type`), or an `auth`, `ping` or `pong`, gets its own error.
    fn before_auth(&self, line: &[u8], e: CommandError) -> CommandError {
        if !self.awaiting_auth() {
            return e;
        }
        let kind = super::command::command_type(line, self.config.max_json_depth);
        match kind.as_deref() {
            Some("subscribe" | "unsubscribe" | "publish") => {
                CommandError::new(e.request_id, ErrorKind::AuthRequired)
            }
            _ => e,
        }
    }

    fn parser(&self) -> CommandParser {
        CommandParser::default().max_depth(self.config.max_json_depth)
    }

    /// Handles one parsed command.
    pub fn handle_command(&mut self, cmd: Command) -> Action {
        self.handle_command_at(cmd, SystemTime::now())
    }

    /// [`Session::handle_command`] at wall-clock time `now` (token expiry is judged against it).
    pub fn handle_command_at(&mut self, cmd: Command, now: SystemTime) -> Action {
        match self.try_command(cmd, now) {
            Ok(action) => action,
            Err(e) => Action::Reply(e.to_reply()),
        }
    }

    /// Reads `line` as a usual `publish` (the parser's fast path), borrowed from it: `None` for
    /// any other line, which goes to [`Session::parse`].
    pub(crate) fn read_publish<'l>(&self, line: &'l [u8]) -> Option<fast::Publish<'l>> {
        fast::publish_ref(line, self.config.max_json_depth)
    }

    /// [`read_publish`](Self::read_publish) of the line at the start of `lines` (an NDJSON
    /// run from a line's start), read without finding its end first: the publish and where the
    /// line's newline is, or for any other line whether `read_publish` of the line alone may
    /// still read it (see [`fast::publish_line`]).
    // Inlined into the push connection's poll, where the publish it returns stays in registers
    // (out of line, the compiler may leave it there: callgrind counted 52 more instructions per
    // publish, the publish copied out through memory and `over_outbox` out of line too).
    #[inline(always)]
    pub(crate) fn read_publish_line<'l>(
        &self,
        lines: &'l [u8],
    ) -> Result<(fast::Publish<'l>, usize), bool> {
        fast::publish_line(lines, self.config.max_json_depth)
    }

    /// Checks a publish [`Session::read_publish`] read as [`Command::Publish`] is checked
    /// (permissions, `$` streams, reserved types, rate limits), without making its command:
    /// `None` to publish it to its topics, or the action that answers it instead (the error
    /// reply, or the close after repeated rate-limit refusals).
    pub(crate) fn check_read_publish(
        &mut self,
        publish: &fast::Publish<'_>,
        now: SystemTime,
    ) -> Option<Action> {
        let by = PublishedBy {
            stream: publish.stream,
            kind: publish.kind,
            device_id: publish.device_id(),
        };
        self.refuse_publish(&publish.id, by, publish.message_len(), now)
    }

    /// The checks of a publish of a `len`-byte message, in order: permissions, `$` streams and
    /// reserved types ([`Session::check_publish`]), then the rate limits. `None` to publish it,
    /// or the action that answers it instead (the error reply, or the close after repeated
    /// rate-limit refusals).
    fn refuse_publish(
        &mut self,
        id: &Option<RequestId>,
        by: PublishedBy<'_>,
        len: usize,
        now: SystemTime,
    ) -> Option<Action> {
        if let Err(e) = self.check_publish(id, by) {
            return Some(Action::Reply(e.to_reply()));
        }
        // No rate limit to take from (nothing configured): the usual case, decided here.
        self.extra.as_ref()?;
        match self.rate_limit(id, len, now) {
            Ok(action) => action,
            Err(e) => Some(Action::Reply(e.to_reply())),
        }
    }

    /// Verifies `token` and makes it the connection's identity.
    fn auth_command(
        &mut self,
        id: Option<RequestId>,
        token: &str,
        now: SystemTime,
    ) -> Result<Action, CommandError> {
        let Some(auth) = self.auth_mut() else {
            // Authentication is off: every connection may do everything already; a client that
            // always authenticates still works.
            return Ok(Action::Reply(reply::authenticated(
                id.as_ref(),
                "anonymous",
                None,
            )));
        };
        match auth.policy.authenticator.verify(token, now) {
            Ok(identity) => auth.accept(id, identity),
            // A fresh token that fails leaves the connection as it was (until its token
            // expires); a first one that fails ends it, as NATS and Centrifugo do.
            Err(e) if auth.identity.is_some() => Err(CommandError::new(id, e.into())),
            Err(e) => Ok(Action::CloseOnAuth {
                request_id: id,
                code: e.code(),
                message: e.to_string(),
            }),
        }
    }

    /// The permissions commands are checked against, or `Err(auth_required)` before the
    /// connection authenticated.
    fn permissions(&self, id: &Option<RequestId>) -> Result<Option<&Permissions>, CommandError> {
        match self.auth() {
            None => Ok(None),
            Some(AuthState {
                identity: Some(identity),
                ..
            }) => Ok(Some(&identity.permissions)),
            Some(_) => Err(CommandError::new(id.clone(), ErrorKind::AuthRequired)),
        }
    }

    fn check_publish(
        &mut self,
        id: &Option<RequestId>,
        meta: PublishedBy<'_>,
    ) -> Result<(), CommandError> {
        let system_stream = || {
            // `$stats` and any other `$` stream: what a reader sees there is the server's.
            let kind = ErrorKind::InvalidValue {
                field: "message.stream",
                reason: "streams whose name starts with `$` belong to the server".into(),
            };
            CommandError::new(id.clone(), kind)
        };
        let Some(auth) = self.auth_mut() else {
            return match meta.stream.starts_with('$') {
                true => Err(system_stream()),
                false => Ok(()),
            };
        };
        let Some(identity) = &auth.identity else {
            return Err(CommandError::new(id.clone(), ErrorKind::AuthRequired));
        };
        let device = meta.device_id;
        match auth
            .cache
            .decide(&identity.permissions, meta.stream, device)
        {
            Decision::Allowed => {}
            Decision::SystemStream => return Err(system_stream()),
            decision => {
                let denied = PermissionDenied {
                    action: permissions::Action::Publish,
                    stream: echo(meta.stream),
                    device: device.map(echo),
                    decision,
                };
                return Err(CommandError::new(id.clone(), denied.into()));
            }
        }
        if !auth.policy.allow_reply_types {
            if let Some(t) = RESERVED_MESSAGE_TYPES.iter().find(|&&t| t == meta.kind) {
                return Err(CommandError::new(id.clone(), ErrorKind::ReservedType(t)));
            }
        }
        Ok(())
    }

    fn try_command(&mut self, cmd: Command, now: SystemTime) -> Result<Action, CommandError> {
        match cmd {
            Command::Subscribe {
                id,
                stream,
                device_id,
                subscription_id,
            } => {
                if let Some(perms) = self.permissions(&id)? {
                    perms
                        .check(
                            permissions::Action::Subscribe,
                            &stream,
                            device_id.as_deref(),
                        )
                        .map_err(|denied| CommandError::new(id.clone(), denied.into()))?;
                }
                // A subscription id in use is refused first: that subscribe would add no
                // subscription, so it is not one beyond the limit.
                if let Some(s) = &subscription_id {
                    if self.subscriptions.contains_key(s.as_str()) {
                        return Err(CommandError::new(
                            id,
                            ErrorKind::DuplicateSubscription(echo(s)),
                        ));
                    }
                }
                if self.subscriptions.len() >= self.config.max_subscriptions {
                    let kind = ErrorKind::TooManySubscriptions {
                        limit: self.config.max_subscriptions,
                    };
                    return Ok(Action::CloseOnLimit {
                        request_id: id,
                        limit: "max_subscriptions_per_connection",
                        message: kind.to_string(),
                    });
                }
                let sub_id: Arc<str> = match subscription_id {
                    Some(s) => s.into(),
                    None => self.generate_id(&stream),
                };
                let topic = match &device_id {
                    Some(d) => device_topic(&stream, d),
                    None => stream_topic(&stream),
                };
                if let Some(auth) = self.auth_mut() {
                    let defaults = auth.policy.user_limits();
                    let (user, own) = auth.identity.as_ref().map_or(("", None), |i| {
                        (i.user.as_str(), i.limits.max_subscriptions)
                    });
                    let max = own.unwrap_or(defaults.1);
                    if !auth.policy.users.add_subscription(user, max) {
                        let message = format!(
                            "user `{}` holds its maximum of max_subscriptions_per_user = {max} subscriptions{}",
                            echo(user),
                            limit_source(own, "max_subscriptions")
                        );
                        return Ok(Action::Reply(reply::error_with_limit(
                            id.as_ref(),
                            super::LIMIT_EXCEEDED,
                            &message,
                            Some("max_subscriptions_per_user"),
                        )));
                    }
                    auth.subscriptions += 1;
                }
                let hub_id = format!("c{}/{}", self.connection_id, sub_id);
                let reply = reply::subscribed(id.as_ref(), &sub_id, &stream, device_id.as_deref());
                let info = SubscriptionInfo {
                    stream,
                    device_id,
                    topic: topic.clone(),
                    hub_id: hub_id.clone(),
                };
                self.subscriptions.insert(Arc::clone(&sub_id), info);
                Ok(Action::Subscribe {
                    subscription_id: sub_id,
                    hub_id,
                    topic,
                    reply,
                })
            }
            Command::Unsubscribe {
                id,
                subscription_id,
            } => {
                self.permissions(&id)?;
                let Some((sub_id, info)) =
                    self.subscriptions.remove_entry(subscription_id.as_str())
                else {
                    return Err(CommandError::new(
                        id,
                        ErrorKind::UnknownSubscription(echo(&subscription_id)),
                    ));
                };
                self.forget_user_subscription();
                let ack = reply::unsubscribed(id.as_ref(), &sub_id);
                Ok(Action::Unsubscribe {
                    subscription_id: sub_id,
                    hub_id: info.hub_id,
                    topic: info.topic,
                    ack,
                })
            }
            Command::Publish { id, message, meta } => {
                let by = PublishedBy::meta(&meta);
                if let Some(action) = self.refuse_publish(&id, by, message.len(), now) {
                    return Ok(action);
                }
                Ok(Action::Publish {
                    request_id: id,
                    topics: publish_topics(&meta),
                    // The whole command line, message included, was validated by the parser.
                    message: Message::json_validated(message),
                    meta,
                })
            }
            Command::Ping { id } => Ok(Action::Reply(reply::pong(id.as_ref()))),
            Command::Pong { .. } => Ok(Action::Pong),
            Command::Auth { id, token } => self.auth_command(id, &token.0, now),
        }
    }

    /// The connection's publish rate limits on one message of `len` bytes: `Ok(None)` when it
    /// passes, the limit error when it does not, or the close once
    /// [`SessionConfig::publish_violations_before_close`] refusals came in a row.
    fn rate_limit(
        &mut self,
        id: &Option<RequestId>,
        len: usize,
        now: SystemTime,
    ) -> Result<Option<Action>, CommandError> {
        let strikes_max = self.config.publish_violations_before_close;
        let Some(extra) = self.extra.as_deref_mut() else {
            return Ok(None);
        };
        let user = extra.auth.as_ref().and_then(|a| a.rate.as_deref());
        let limiter = &mut extra.limiter;
        let checked = limiter.check(len, now).and_then(|()| {
            user.map_or(Ok(()), |user| user.check(len, now))
                .inspect_err(|_| {
                    // The user's limit refused what the connection's took: it gives it back.
                    limiter.give_back(len);
                })
        });
        match checked {
            Ok(()) => {
                extra.strikes = 0;
                Ok(None)
            }
            Err(limited) => {
                extra.strikes = extra.strikes.saturating_add(1);
                let kind = ErrorKind::RateLimited {
                    limit: limited.limit,
                    rate: limited.rate,
                };
                if strikes_max > 0 && extra.strikes >= strikes_max {
                    return Ok(Some(Action::CloseOnLimit {
                        request_id: id.clone(),
                        limit: limited.limit,
                        message: format!(
                            "{kind}; {strikes_max} refused publishes in a row (publish_violations_before_close), closing the connection"
                        ),
                    }));
                }
                Err(CommandError::new(id.clone(), kind))
            }
        }
    }

    fn forget_user_subscription(&mut self) {
        if let Some(auth) = self.auth_mut() {
            if auth.subscriptions > 0 {
                auth.subscriptions -= 1;
                if let Some(identity) = &auth.identity {
                    auth.policy.users.remove_subscription(&identity.user);
                }
            }
        }
    }

    /// `stream-N`, unique on the connection and at most [`MAX_NAME_BYTES`] long like an id a
    /// client gives: a stream name near that length is cut (at a character boundary) to make
    /// room for the number.
    fn generate_id(&mut self, stream: &str) -> Arc<str> {
        loop {
            let suffix = format!("-{}", self.next_id);
            let mut head = MAX_NAME_BYTES
                .saturating_sub(suffix.len())
                .min(stream.len());
            while !stream.is_char_boundary(head) {
                head -= 1;
            }
            let candidate = format!("{}{suffix}", &stream[..head]);
            self.next_id += 1;
            if !self.subscriptions.contains_key(candidate.as_str()) {
                return candidate.into();
            }
        }
    }

    /// The hub refused the subscription of an [`Action::Subscribe`]: forgets it and returns the
    /// error reply to push instead of the `subscribed` reply.
    pub fn subscribe_failed(
        &mut self,
        subscription_id: &str,
        request_id: Option<&RequestId>,
        reason: &str,
    ) -> Bytes {
        if self.subscriptions.remove(subscription_id).is_some() {
            self.forget_user_subscription();
        }
        reply::error(request_id, powerhub_plugin::codes::SUBSCRIBE_FAILED, reason)
    }

    /// The final error to write before closing a connection whose stream protocol rejected its
    /// input: over a limit (a line too long to frame),
    /// `{"type":"error","requestId":null,"code":"limit_exceeded","message":"...; closing the connection","limit":"<key>"}`;
    /// otherwise (input that cannot be framed) the same with `code` `fatal` and no `limit`.
    pub fn fatal_error(err: &powerhub_plugin::ProtocolError) -> Bytes {
        let message = format!("{err}; closing the connection");
        match err {
            powerhub_plugin::ProtocolError::TooLarge { limit_name, .. } => {
                reply::error_with_limit(None, super::LIMIT_EXCEEDED, &message, Some(limit_name))
            }
            _ => CommandError::new(None, ErrorKind::Fatal(err.to_string())).to_reply(),
        }
    }

    /// The subscription `subscription_id`, if this connection has it.
    pub fn subscription(&self, subscription_id: &str) -> Option<&SubscriptionInfo> {
        self.subscriptions.get(subscription_id)
    }

    /// Every subscription: (subscription id, info).
    pub fn subscriptions(&self) -> impl Iterator<Item = (&Arc<str>, &SubscriptionInfo)> {
        self.subscriptions.0.iter().map(|(id, info)| (id, info))
    }

    /// Forgets every subscription and returns them, for teardown (unsubscribe each `hub_id`).
    /// The connection's place in its user's counts (`max_connections_per_user`,
    /// `max_subscriptions_per_user`) is given back now, not when the session is dropped: a
    /// connection the server closes may wait for its peer a while, and the user's next one
    /// must not be refused meanwhile.
    pub fn close(&mut self) -> Vec<(Arc<str>, SubscriptionInfo)> {
        if let Some(auth) = self.auth_mut() {
            auth.release();
        }
        std::mem::take(&mut self.subscriptions.0)
    }

    /// The limits.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }
}

/// A session's subscriptions by id.
#[derive(Debug, Default)]
struct SubList(Vec<(Arc<str>, SubscriptionInfo)>);

impl SubList {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn position(&self, id: &str) -> Option<usize> {
        self.0.iter().position(|(k, _)| &**k == id)
    }

    fn contains_key(&self, id: &str) -> bool {
        self.position(id).is_some()
    }

    fn get(&self, id: &str) -> Option<&SubscriptionInfo> {
        self.position(id).map(|i| &self.0[i].1)
    }

    /// Adds a subscription whose id is not held yet.
    fn insert(&mut self, id: Arc<str>, info: SubscriptionInfo) {
        if self.0.capacity() == 0 {
            // The first subscription gets one slot, not the four a first push reserves.
            self.0.reserve_exact(1);
        }
        self.0.push((id, info));
    }

    fn remove_entry(&mut self, id: &str) -> Option<(Arc<str>, SubscriptionInfo)> {
        self.position(id).map(|i| self.0.swap_remove(i))
    }

    fn remove(&mut self, id: &str) -> Option<SubscriptionInfo> {
        self.remove_entry(id).map(|(_, info)| info)
    }
}
