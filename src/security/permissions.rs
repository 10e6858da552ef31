//! What an authenticated user may publish and subscribe to: lists of allow and deny patterns.
//!
//! A **subject** is what a command touches: a stream `S`, or device `D` of stream `S`, written
//! `S/D` (the two topics of the push protocol). A subject has one or two **segments**: the stream,
//! then the device. The device is one segment even when it contains `/` (`deviceId` may; a stream
//! name may not), so a subject is split at its first `/` only.
//!
//! A **pattern** has the same shape, and each of its segments is a literal, `*` (any one segment)
//! or `>` (the rest: one segment or more):
//!
//! | pattern | matches |
//! | --- | --- |
//! | `obs` | stream `obs` (a subscription to every device, or a publication without a device) |
//! | `obs/dev1` | device `dev1` of stream `obs` |
//! | `obs/*`, `obs/>` | any device of `obs` (at the device segment the two coincide) |
//! | `*` | any stream, without a device |
//! | `*/dev1` | device `dev1` of any stream |
//! | `>` | everything |
//!
//! A wildcard must be a whole segment: `obs*` and `a/b>` are refused with a
//! [`PatternError`] rather than read as literals, so that a mistyped prefix pattern does not
//! silently match nothing.
//!
//! ## How a decision is made
//!
//! - **Deny wins**: a subject matched by a deny pattern is refused whatever the allow list says.
//! - **Default deny**: a subject no allow pattern matches is refused ([`Permissions::none`] is
//!   what a user without permissions gets once authentication is on).
//! - **System streams** (names starting with `$`, such as `$stats`) belong to the server:
//!   publishing to one is always refused, and a wildcard in the stream segment of an *allow*
//!   pattern never matches one, so reading `$stats` needs an allow pattern that names it
//!   (`$stats`). In a *deny* pattern wildcards do match system streams (a broader deny is the
//!   safer reading).
//! - A subscription to a whole stream `S` receives every device's messages, so it is refused when
//!   a deny pattern covers **any** device of `S` (deny `obs/secret` refuses subscribing to `obs`,
//!   but not to `obs/dev1`).
//! - A deny pattern matching a stream `S` covers its devices too: a device's messages are the
//!   stream's, so deny `obs` refuses subscribing to `obs/dev1` and publishing to `obs` with a
//!   device as well.
//! - A publication with a device is judged on `S/D` (and on `S` for deny), one without on `S`:
//!   to let a user publish everything in `obs`, allow both `obs` and `obs/>`.
//!
//! Patterns are parsed once ([`Permissions::compile`]); a decision walks the lists without
//! allocating. The publish path is expected to go through a [`PublishCache`] per connection, so
//! that a publisher pays one small lookup per message.
//!
//! ```
//! use powerhub::security::permissions::{Decision, Permissions, PermissionsConfig, RulesConfig};
//!
//! let config = PermissionsConfig {
//!     publish: RulesConfig { allow: vec!["obs/>".into()], deny: vec![] },
//!     subscribe: RulesConfig {
//!         allow: vec![">".into(), "$stats".into()],
//!         deny: vec!["obs/secret".into()],
//!     },
//! };
//! let p = Permissions::compile(&config).unwrap();
//! assert!(p.publish("obs", Some("dev1")).is_allowed());
//! assert_eq!(p.publish("obs", None), Decision::NotAllowed);
//! assert_eq!(p.publish("$stats", None), Decision::SystemStream);
//! assert!(p.subscribe("obs", Some("dev1")).is_allowed());
//! assert_eq!(p.subscribe("obs", Some("secret")), Decision::Denied);
//! assert_eq!(p.subscribe("obs", None), Decision::Denied); // it would receive `secret`'s messages
//! assert!(p.subscribe("$stats", None).is_allowed());
//! ```

use std::fmt;

use serde::Deserialize;

/// The longest literal stream segment a pattern may have: the protocol's longest stream name.
pub const MAX_STREAM_BYTES: usize = 256;

/// What a client asks to do with a subject.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Publish a message to it.
    Publish,
    /// Subscribe to it.
    Subscribe,
}

impl Action {
    /// `publish` or `subscribe`.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Publish => "publish",
            Action::Subscribe => "subscribe",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The outcome of a permission check. Only [`Decision::Allowed`] lets the command through; the
/// others say why it was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Decision {
    /// An allow pattern matches and no deny pattern does.
    Allowed,
    /// No allow pattern matches (default deny).
    NotAllowed,
    /// A deny pattern matches (deny wins).
    Denied,
    /// The stream is a system stream (`$…`): clients never publish to one.
    SystemStream,
}

impl Decision {
    /// Whether the command may go ahead.
    pub fn is_allowed(self) -> bool {
        self == Decision::Allowed
    }

    /// Why the command was refused, in words (`"no allow pattern matches"`); empty when allowed.
    pub fn reason(self) -> &'static str {
        match self {
            Decision::Allowed => "",
            Decision::NotAllowed => "no allow pattern matches",
            Decision::Denied => "a deny pattern matches",
            Decision::SystemStream => "streams starting with `$` belong to the server",
        }
    }
}

/// A refused publish or subscribe, ready for the protocol's error reply (code
/// [`PermissionDenied::CODE`]); the connection stays open.
///
/// ```
/// use powerhub::security::permissions::{Action, Permissions};
///
/// let err = Permissions::none().check(Action::Subscribe, "obs", Some("dev1")).unwrap_err();
/// assert_eq!(err.code(), "permission_denied");
/// assert_eq!(
///     err.to_string(),
///     "subscribe to stream `obs` device `dev1` is not permitted: no allow pattern matches"
/// );
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{action} to stream `{stream}`{} is not permitted: {}",
    device.as_deref().map(|d| format!(" device `{d}`")).unwrap_or_default(),
    decision.reason()
)]
pub struct PermissionDenied {
    /// What was asked.
    pub action: Action,
    /// The stream.
    pub stream: String,
    /// The device, when the command named one.
    pub device: Option<String>,
    /// Why it was refused (never [`Decision::Allowed`]).
    pub decision: Decision,
}

impl PermissionDenied {
    /// The protocol error code of every refused publish or subscribe.
    pub const CODE: &'static str = "permission_denied";

    /// [`PermissionDenied::CODE`].
    pub fn code(&self) -> &'static str {
        Self::CODE
    }
}

/// An invalid pattern in a permission list. Names the list and the pattern.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PatternError {
    /// The pattern does not parse.
    #[error("invalid permission pattern `{pattern}` in {list}: {reason}")]
    Syntax {
        /// The list: `publish.allow`, `publish.deny`, `subscribe.allow` or `subscribe.deny`.
        list: &'static str,
        /// The pattern as written.
        pattern: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A publish allow pattern names a system stream, which no client may publish to.
    #[error(
        "permission pattern `{pattern}` in publish.allow names a system stream: clients never \
         publish to streams starting with `$`"
    )]
    SystemStreamPublish {
        /// The pattern as written.
        pattern: String,
    },
}

/// One list of the configuration: patterns that allow, patterns that deny.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RulesConfig {
    /// Subjects permitted (default: none).
    pub allow: Vec<String>,
    /// Subjects refused even when an allow pattern matches them.
    pub deny: Vec<String>,
}

/// A user's permissions as written in the configuration (`permissions = { publish = { allow =
/// [...] }, subscribe = { ... } }` under an `[[auth.tokens]]` entry) or in a JWT's permissions
/// claim (the same shape as a JSON object). Absent lists are empty: nothing is permitted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PermissionsConfig {
    /// What the user may publish to.
    pub publish: RulesConfig,
    /// What the user may subscribe to.
    pub subscribe: RulesConfig,
}

/// The reader of [`RulesConfig`] (see [`super::deserialize_from_map_only`]).
#[derive(Deserialize)]
#[serde(remote = "RulesConfig", deny_unknown_fields)]
struct RulesConfigDef {
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
}

/// The reader of [`PermissionsConfig`] (see [`super::deserialize_from_map_only`]).
#[derive(Deserialize)]
#[serde(remote = "PermissionsConfig", deny_unknown_fields)]
struct PermissionsConfigDef {
    #[serde(default)]
    publish: RulesConfig,
    #[serde(default)]
    subscribe: RulesConfig,
}

super::deserialize_from_map_only!(RulesConfig, RulesConfigDef);
super::deserialize_from_map_only!(PermissionsConfig, PermissionsConfigDef);

/// One segment of a compiled pattern.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    /// `*`: any one segment.
    One,
    /// `>`: one segment or more (only last).
    Rest,
}

/// A parsed pattern: a stream segment and, unless the stream segment is `>`, an optional device
/// segment.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    stream: Segment,
    device: Option<Segment>,
}

fn is_system(stream: &str) -> bool {
    stream.starts_with('$')
}

impl Pattern {
    fn parse(text: &str, list: &'static str) -> Result<Pattern, PatternError> {
        let syntax = |reason| PatternError::Syntax {
            list,
            pattern: text.to_owned(),
            reason,
        };
        let segment = |s: &str, what: &'static str| -> Result<Segment, PatternError> {
            match s {
                "" => Err(syntax(if what == "stream" {
                    "the stream segment is empty"
                } else {
                    "the device segment is empty"
                })),
                "*" => Ok(Segment::One),
                ">" => Ok(Segment::Rest),
                s if s.contains('/') && s.contains(['*', '>']) => Err(syntax(
                    "a wildcard (`*` or `>`) must be a whole segment, and a pattern has two: \
                     the stream, then the device (everything after the first `/`, which may \
                     hold `/` itself)",
                )),
                s if s.contains(['*', '>']) => {
                    Err(syntax("a wildcard (`*` or `>`) must be a whole segment"))
                }
                s => Ok(Segment::Literal(s.into())),
            }
        };
        if text.is_empty() {
            return Err(syntax("the pattern is empty"));
        }
        let (stream, device) = match text.split_once('/') {
            Some((s, d)) => (s, Some(d)),
            None => (text, None),
        };
        let stream = segment(stream, "stream")?;
        if let Segment::Literal(s) = &stream {
            if s.len() > MAX_STREAM_BYTES {
                return Err(syntax("the stream segment is longer than 256 bytes"));
            }
        }
        let device = device.map(|d| segment(d, "device")).transpose()?;
        if stream == Segment::Rest && device.is_some() {
            return Err(syntax("`>` must be the last segment"));
        }
        Ok(Pattern { stream, device })
    }

    /// Whether the stream segment matches `stream`. In an allow pattern a wildcard does not match
    /// a system stream.
    fn stream_matches(&self, stream: &str, allow: bool) -> bool {
        match &self.stream {
            Segment::Literal(s) => &**s == stream,
            Segment::One | Segment::Rest => !(allow && is_system(stream)),
        }
    }

    fn matches(&self, stream: &str, device: Option<&str>, allow: bool) -> bool {
        if !self.stream_matches(stream, allow) {
            return false;
        }
        if self.stream == Segment::Rest {
            return true;
        }
        match (&self.device, device) {
            (None, None) => true,
            (Some(Segment::Literal(p)), Some(d)) => &**p == d,
            (Some(Segment::One | Segment::Rest), Some(_)) => true,
            _ => false,
        }
    }

    /// Whether this (deny) pattern matches some device of `stream`.
    fn covers_a_device_of(&self, stream: &str) -> bool {
        self.stream_matches(stream, false)
            && (self.stream == Segment::Rest || self.device.is_some())
    }
}

/// Compiled allow and deny lists for one action.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Rules {
    allow: Vec<Pattern>,
    deny: Vec<Pattern>,
}

impl Rules {
    fn compile(
        config: &RulesConfig,
        allow_list: &'static str,
        deny_list: &'static str,
    ) -> Result<Rules, PatternError> {
        let parse = |v: &[String], list| {
            v.iter()
                .map(|p| Pattern::parse(p, list))
                .collect::<Result<Vec<_>, _>>()
        };
        Ok(Rules {
            allow: parse(&config.allow, allow_list)?,
            deny: parse(&config.deny, deny_list)?,
        })
    }

    fn allows(&self, stream: &str, device: Option<&str>) -> bool {
        self.allow.iter().any(|p| p.matches(stream, device, true))
    }

    fn denies(&self, stream: &str, device: Option<&str>) -> bool {
        self.deny.iter().any(|p| p.matches(stream, device, false))
    }
}

/// A user's compiled permissions: patterns parsed once, decisions made without allocating.
///
/// Built by [`Permissions::compile`] from a [`PermissionsConfig`]; [`Permissions::none`] (the
/// default) permits nothing, [`Permissions::unrestricted`] is what a connection gets while
/// authentication is off.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Permissions {
    publish: Rules,
    subscribe: Rules,
    unrestricted: bool,
}

impl Permissions {
    /// Parses every pattern of `config`.
    ///
    /// # Errors
    ///
    /// The first invalid pattern, named with its list; a publish allow pattern whose stream
    /// segment is a literal system stream (`$stats`) is refused too, since it could never apply.
    ///
    /// ```
    /// use powerhub::security::permissions::{PatternError, Permissions, PermissionsConfig};
    ///
    /// let mut config = PermissionsConfig::default();
    /// config.subscribe.allow = vec!["obs*".into()];
    /// let err = Permissions::compile(&config).unwrap_err();
    /// assert!(matches!(err, PatternError::Syntax { list: "subscribe.allow", .. }));
    /// assert!(err.to_string().contains("`obs*`"));
    /// ```
    pub fn compile(config: &PermissionsConfig) -> Result<Permissions, PatternError> {
        let publish = Rules::compile(&config.publish, "publish.allow", "publish.deny")?;
        for (text, p) in config.publish.allow.iter().zip(&publish.allow) {
            if matches!(&p.stream, Segment::Literal(s) if is_system(s)) {
                return Err(PatternError::SystemStreamPublish {
                    pattern: text.clone(),
                });
            }
        }
        Ok(Permissions {
            publish,
            subscribe: Rules::compile(&config.subscribe, "subscribe.allow", "subscribe.deny")?,
            unrestricted: false,
        })
    }

    /// Nothing permitted: what a user whose configuration or token grants no permissions gets.
    pub fn none() -> Permissions {
        Permissions::default()
    }

    /// Every subscription (system streams included, as the server allows today) and every
    /// publication except to system streams: the policy while authentication is off.
    ///
    /// ```
    /// use powerhub::security::permissions::{Decision, Permissions};
    ///
    /// let p = Permissions::unrestricted();
    /// assert!(p.subscribe("$stats", None).is_allowed());
    /// assert!(p.publish("obs", Some("d")).is_allowed());
    /// assert_eq!(p.publish("$stats", None), Decision::SystemStream);
    /// ```
    pub fn unrestricted() -> Permissions {
        Permissions {
            unrestricted: true,
            ..Permissions::default()
        }
    }

    /// May a message for `stream` (and `device`, when it has one) be published?
    pub fn publish(&self, stream: &str, device: Option<&str>) -> Decision {
        if is_system(stream) {
            Decision::SystemStream
        } else if self.unrestricted {
            Decision::Allowed
        } else if self.publish.denies(stream, device)
            || (device.is_some() && self.publish.denies(stream, None))
        {
            // A device's publication reaches the stream's whole-stream subscribers too: a deny
            // of the stream covers it (as a deny of a device refuses a whole-stream subscribe).
            Decision::Denied
        } else if self.publish.allows(stream, device) {
            Decision::Allowed
        } else {
            Decision::NotAllowed
        }
    }

    /// May the user subscribe to `stream` (one `device` of it, or every device when `None`)?
    pub fn subscribe(&self, stream: &str, device: Option<&str>) -> Decision {
        if self.unrestricted {
            return Decision::Allowed;
        }
        let denied = self.subscribe.denies(stream, device)
            // A device's messages are the stream's: a deny of the stream covers it.
            || (device.is_some() && self.subscribe.denies(stream, None))
            || (device.is_none()
                && self
                    .subscribe
                    .deny
                    .iter()
                    .any(|p| p.covers_a_device_of(stream)));
        if denied {
            Decision::Denied
        } else if self.subscribe.allows(stream, device) {
            Decision::Allowed
        } else {
            Decision::NotAllowed
        }
    }

    /// [`Permissions::publish`] or [`Permissions::subscribe`], as a `Result` whose error is ready
    /// for the protocol's reply. Allocates only when refusing.
    pub fn check(
        &self,
        action: Action,
        stream: &str,
        device: Option<&str>,
    ) -> Result<(), PermissionDenied> {
        let decision = match action {
            Action::Publish => self.publish(stream, device),
            Action::Subscribe => self.subscribe(stream, device),
        };
        if decision.is_allowed() {
            Ok(())
        } else {
            Err(PermissionDenied {
                action,
                stream: stream.to_owned(),
                device: device.map(str::to_owned),
                decision,
            })
        }
    }
}

/// A connection's memory of its recent publish decisions, so that a publisher streaming to a few
/// subjects pays one short scan per message instead of walking the pattern lists.
///
/// Bounded: at most `capacity` entries, the oldest replaced first; a replaced entry's buffers are
/// reused, so a full cache allocates nothing on a miss either once its strings have grown. Call
/// [`PublishCache::clear`] whenever the connection's [`Permissions`] change (a fresh token).
///
/// ```
/// use powerhub::security::permissions::{Permissions, PermissionsConfig, PublishCache};
///
/// let mut config = PermissionsConfig::default();
/// config.publish.allow = vec!["obs/*".into()];
/// let perms = Permissions::compile(&config).unwrap();
/// let mut cache = PublishCache::new();
/// assert!(cache.decide(&perms, "obs", Some("d1")).is_allowed()); // computed, remembered
/// assert!(cache.decide(&perms, "obs", Some("d1")).is_allowed()); // looked up
/// assert!(!cache.decide(&perms, "other", None).is_allowed());
/// assert_eq!(cache.len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct PublishCache {
    entries: Vec<CacheEntry>,
    capacity: usize,
    /// The entry replaced next once the cache is full.
    next: usize,
    /// The entry of the last decision: a publisher mostly publishes to one subject, which is
    /// then compared directly, without hashing.
    last: usize,
}

#[derive(Debug, Clone)]
struct CacheEntry {
    hash: u64,
    stream: String,
    has_device: bool,
    device: String,
    decision: Decision,
}

impl CacheEntry {
    fn is(&self, hash: u64, stream: &str, device: Option<&str>) -> bool {
        self.hash == hash && self.is_subject(stream, device)
    }

    fn is_subject(&self, stream: &str, device: Option<&str>) -> bool {
        self.stream == stream
            && match device {
                Some(d) => self.has_device && self.device == d,
                None => !self.has_device,
            }
    }
}

/// FNV-1a over the subject, with a marker telling "no device" from "empty device".
fn subject_hash(stream: &str, device: Option<&str>) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(PRIME);
        }
    };
    eat(stream.as_bytes());
    match device {
        Some(d) => {
            eat(&[0xff]);
            eat(d.as_bytes());
        }
        None => eat(&[0xfe]),
    }
    h
}

impl Default for PublishCache {
    fn default() -> Self {
        PublishCache::new()
    }
}

impl PublishCache {
    /// How many subjects [`PublishCache::new`] remembers.
    pub const DEFAULT_CAPACITY: usize = 8;

    /// A cache of [`PublishCache::DEFAULT_CAPACITY`] entries.
    pub fn new() -> PublishCache {
        PublishCache::with_capacity(Self::DEFAULT_CAPACITY)
    }

    /// A cache of at most `capacity` entries (0: every decision is computed afresh).
    pub fn with_capacity(capacity: usize) -> PublishCache {
        PublishCache {
            entries: Vec::new(),
            capacity,
            next: 0,
            last: 0,
        }
    }

    /// The decision for publishing to `stream` (and `device`) under `permissions`: remembered,
    /// or computed with [`Permissions::publish`] and remembered.
    pub fn decide(
        &mut self,
        permissions: &Permissions,
        stream: &str,
        device: Option<&str>,
    ) -> Decision {
        if let Some(e) = self.entries.get(self.last) {
            if e.is_subject(stream, device) {
                return e.decision;
            }
        }
        let hash = subject_hash(stream, device);
        if let Some(i) = self.entries.iter().position(|e| e.is(hash, stream, device)) {
            self.last = i;
            return self.entries[i].decision;
        }
        let decision = permissions.publish(stream, device);
        if self.capacity == 0 {
            return decision;
        }
        if self.entries.len() < self.capacity {
            self.last = self.entries.len();
            self.entries.push(CacheEntry {
                hash,
                stream: stream.to_owned(),
                has_device: device.is_some(),
                device: device.unwrap_or_default().to_owned(),
                decision,
            });
        } else {
            let e = &mut self.entries[self.next];
            self.last = self.next;
            self.next = (self.next + 1) % self.capacity;
            e.hash = hash;
            e.stream.clear();
            e.stream.push_str(stream);
            e.has_device = device.is_some();
            e.device.clear();
            e.device.push_str(device.unwrap_or_default());
            e.decision = decision;
        }
        decision
    }

    /// Forgets every decision (keeps the buffers).
    pub fn clear(&mut self) {
        self.entries.clear();
        self.next = 0;
        self.last = 0;
    }

    /// How many decisions are remembered.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no decision is remembered.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rules(allow: &[&str], deny: &[&str]) -> RulesConfig {
        RulesConfig {
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn perms(publish: RulesConfig, subscribe: RulesConfig) -> Permissions {
        Permissions::compile(&PermissionsConfig { publish, subscribe }).expect("valid patterns")
    }

    fn sub(allow: &[&str], deny: &[&str]) -> Permissions {
        perms(RulesConfig::default(), rules(allow, deny))
    }

    #[test]
    fn pattern_table_of_the_module_docs() {
        let cases: &[(&str, &str, Option<&str>, bool)] = &[
            ("obs", "obs", None, true),
            ("obs", "obs", Some("d"), false),
            ("obs/dev1", "obs", Some("dev1"), true),
            ("obs/dev1", "obs", Some("dev2"), false),
            ("obs/dev1", "obs", None, false),
            ("obs/*", "obs", Some("d"), true),
            ("obs/*", "obs", Some("a/b"), true),
            ("obs/*", "obs", None, false),
            ("obs/>", "obs", Some("a/b"), true),
            ("obs/>", "obs", None, false),
            ("*", "any", None, true),
            ("*", "any", Some("d"), false),
            ("*/dev1", "x", Some("dev1"), true),
            ("*/dev1", "x", Some("dev2"), false),
            (">", "x", None, true),
            (">", "x", Some("y"), true),
            ("obs/a/b", "obs", Some("a/b"), true),
            ("obs/a/b", "obs", Some("a"), false),
        ];
        for &(pattern, stream, device, expected) in cases {
            let p = sub(&[pattern], &[]);
            assert_eq!(
                p.subscribe(stream, device).is_allowed(),
                expected,
                "{pattern} against {stream} {device:?}"
            );
        }
    }

    #[test]
    fn deny_wins_and_default_is_deny() {
        let p = sub(&[">"], &["secret", "obs/hidden"]);
        assert_eq!(p.subscribe("secret", None), Decision::Denied);
        assert_eq!(p.subscribe("obs", Some("hidden")), Decision::Denied);
        assert_eq!(p.subscribe("obs", Some("shown")), Decision::Allowed);
        assert_eq!(
            Permissions::none().subscribe("obs", None),
            Decision::NotAllowed
        );
        assert_eq!(
            Permissions::none().publish("obs", None),
            Decision::NotAllowed
        );
    }

    #[test]
    fn a_stream_wide_subscription_is_refused_when_a_device_of_it_is_denied() {
        let p = sub(&[">"], &["obs/hidden", "*/private"]);
        assert_eq!(p.subscribe("obs", None), Decision::Denied);
        assert_eq!(p.subscribe("other", None), Decision::Denied); // `*/private`
        let p = sub(&[">"], &["obs/hidden"]);
        assert_eq!(p.subscribe("other", None), Decision::Allowed);
        assert_eq!(p.subscribe("obs", Some("dev1")), Decision::Allowed);
    }

    #[test]
    fn a_device_subscription_is_refused_when_its_stream_is_denied() {
        let p = sub(&[">"], &["secret"]);
        assert_eq!(p.subscribe("secret", None), Decision::Denied);
        assert_eq!(p.subscribe("secret", Some("d")), Decision::Denied);
        assert_eq!(p.subscribe("other", Some("d")), Decision::Allowed);
    }

    #[test]
    fn a_device_publication_is_refused_when_its_stream_is_denied() {
        let p = perms(rules(&[">"], &["obs", "*/private"]), rules(&[">"], &[]));
        assert_eq!(p.publish("obs", None), Decision::Denied);
        // It would reach the subscribers of all of `obs`.
        assert_eq!(p.publish("obs", Some("dev1")), Decision::Denied);
        assert_eq!(p.publish("other", Some("private")), Decision::Denied);
        assert_eq!(p.publish("other", Some("dev1")), Decision::Allowed);
        // A deny of one device leaves the stream and its other devices.
        let p = perms(rules(&[">"], &["obs/hidden"]), rules(&[">"], &[]));
        assert_eq!(p.publish("obs", None), Decision::Allowed);
        assert_eq!(p.publish("obs", Some("dev1")), Decision::Allowed);
        assert_eq!(p.publish("obs", Some("hidden")), Decision::Denied);
    }

    #[test]
    fn system_streams_need_a_pattern_naming_them_and_are_never_published_to() {
        let p = sub(&[">", "*", "*/*"], &[]);
        assert_eq!(p.subscribe("$stats", None), Decision::NotAllowed);
        assert_eq!(p.subscribe("$stats", Some("x")), Decision::NotAllowed);
        let p = sub(&["$stats"], &[]);
        assert_eq!(p.subscribe("$stats", None), Decision::Allowed);
        assert_eq!(p.subscribe("$other", None), Decision::NotAllowed);
        // A wildcard in a deny pattern does reach system streams.
        let p = sub(&["$stats"], &[">"]);
        assert_eq!(p.subscribe("$stats", None), Decision::Denied);

        let p = perms(rules(&[">", "*"], &[]), RulesConfig::default());
        assert_eq!(p.publish("$stats", None), Decision::SystemStream);
        assert_eq!(p.publish("obs", None), Decision::Allowed);
        let err = Permissions::compile(&PermissionsConfig {
            publish: rules(&["$stats"], &[]),
            subscribe: RulesConfig::default(),
        })
        .unwrap_err();
        assert_eq!(
            err,
            PatternError::SystemStreamPublish {
                pattern: "$stats".into()
            }
        );
        // Denying a system stream's publication is pointless but harmless.
        perms(rules(&[], &["$stats"]), RulesConfig::default());
    }

    #[test]
    fn syntax_errors_name_the_pattern_and_the_list() {
        let long = "s".repeat(257);
        let cases: &[(&str, &str)] = &[
            ("", "the pattern is empty"),
            ("/d", "the stream segment is empty"),
            ("obs/", "the device segment is empty"),
            ("obs*", "a wildcard (`*` or `>`) must be a whole segment"),
            ("obs/d*", "a wildcard (`*` or `>`) must be a whole segment"),
            (
                "obs/a/>",
                "a wildcard (`*` or `>`) must be a whole segment, and a pattern has two: the \
                 stream, then the device (everything after the first `/`, which may hold `/` \
                 itself)",
            ),
            (">/d", "`>` must be the last segment"),
            (&long, "the stream segment is longer than 256 bytes"),
        ];
        for &(pattern, reason) in cases {
            let err = Permissions::compile(&PermissionsConfig {
                publish: rules(&[], &[pattern]),
                subscribe: RulesConfig::default(),
            })
            .unwrap_err();
            assert_eq!(
                err,
                PatternError::Syntax {
                    list: "publish.deny",
                    pattern: pattern.into(),
                    reason
                }
            );
            assert!(err.to_string().contains(&format!("`{pattern}`")));
        }
    }

    #[test]
    fn check_names_the_stream_and_device() {
        let p = perms(rules(&["obs"], &[]), RulesConfig::default());
        assert!(p.check(Action::Publish, "obs", None).is_ok());
        let err = p.check(Action::Publish, "obs", Some("d")).unwrap_err();
        assert_eq!(err.stream, "obs");
        assert_eq!(err.device.as_deref(), Some("d"));
        assert_eq!(err.decision, Decision::NotAllowed);
        assert_eq!(
            err.to_string(),
            "publish to stream `obs` device `d` is not permitted: no allow pattern matches"
        );
        let err = p.check(Action::Publish, "$stats", None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "publish to stream `$stats` is not permitted: streams starting with `$` belong to the \
             server"
        );
    }

    #[test]
    fn config_parses_from_toml_and_json_and_refuses_unknown_keys() {
        let c: PermissionsConfig = toml::from_str(
            r#"
            publish = { allow = ["obs/>"] }
            subscribe = { allow = [">"], deny = ["obs/secret"] }
            "#,
        )
        .unwrap();
        assert_eq!(c.publish.allow, ["obs/>"]);
        assert!(c.publish.deny.is_empty());
        let j: PermissionsConfig =
            serde_json::from_str(r#"{"subscribe":{"allow":["$stats"]}}"#).unwrap();
        assert_eq!(j.subscribe.allow, ["$stats"]);
        assert!(toml::from_str::<PermissionsConfig>("read = { allow = [] }").is_err());
        assert!(serde_json::from_str::<PermissionsConfig>(r#"{"publish":{"alow":[]}}"#).is_err());
    }

    #[test]
    fn cache_remembers_replaces_the_oldest_and_clears() {
        let p = perms(rules(&["a/*"], &[]), RulesConfig::default());
        let mut c = PublishCache::with_capacity(2);
        assert!(c.decide(&p, "a", Some("1")).is_allowed());
        assert!(!c.decide(&p, "a", None).is_allowed());
        assert_eq!(c.len(), 2);
        assert!(!c.decide(&p, "b", Some("1")).is_allowed()); // replaces ("a", "1")
        assert_eq!(c.len(), 2);
        assert!(c
            .entries
            .iter()
            .all(|e| !e.is(subject_hash("a", Some("1")), "a", Some("1"))));
        // An empty device and no device are different subjects.
        assert_ne!(subject_hash("a", Some("")), subject_hash("a", None));
        c.clear();
        assert!(c.is_empty());
        let mut none = PublishCache::with_capacity(0);
        assert!(none.decide(&p, "a", Some("1")).is_allowed());
        assert!(none.is_empty());
    }

    #[test]
    fn cache_decides_as_the_permissions_for_any_sequence_of_subjects() {
        let p = perms(
            rules(&["a/*", "b", "c/>"], &["a/x"]),
            RulesConfig::default(),
        );
        let streams = ["a", "b", "c", "d"];
        let devices = [None, Some(""), Some("x"), Some("y")];
        for capacity in [1, 2, 3, 8] {
            let mut c = PublishCache::with_capacity(capacity);
            let mut seed = 0x2545_f491_4f6c_dd1d_u64;
            for _ in 0..5_000 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                // Runs of one subject (the last-decision path) mixed with jumps.
                let (stream, device) = (
                    streams[(seed % 4) as usize],
                    devices[((seed >> 8) % 4) as usize],
                );
                let repeats = 1 + (seed >> 16) % 3;
                for _ in 0..repeats {
                    assert_eq!(
                        c.decide(&p, stream, device),
                        p.publish(stream, device),
                        "{stream} {device:?} (capacity {capacity})"
                    );
                }
            }
        }
    }

    // ---- the plain model: patterns and subjects as lists of segments, matched recursively ----

    /// `S` -> [S], `S/D` -> [S, D] (split at the first `/` only).
    fn segments(s: &str) -> Vec<&str> {
        match s.split_once('/') {
            Some((a, b)) => vec![a, b],
            None => vec![s],
        }
    }

    fn model_valid(p: &str) -> bool {
        let segs = segments(p);
        let whole = |s: &str| !s.is_empty() && (s == "*" || s == ">" || !s.contains(['*', '>']));
        segs.iter().all(|s| whole(s))
            && !(segs.len() == 2 && segs[0] == ">")
            && (segs[0].len() <= MAX_STREAM_BYTES || segs[0] == "*" || segs[0] == ">")
    }

    fn model_match(p: &[&str], s: &[&str], allow: bool, first: bool) -> bool {
        let reaches = |seg: &str| !(allow && first && seg.starts_with('$'));
        match (p.first(), s.first()) {
            (None, None) => true,
            (Some(&">"), Some(seg)) => reaches(seg),
            (Some(&"*"), Some(seg)) => reaches(seg) && model_match(&p[1..], &s[1..], allow, false),
            (Some(lit), Some(seg)) => lit == seg && model_match(&p[1..], &s[1..], allow, false),
            _ => false,
        }
    }

    fn subject(stream: &str, device: Option<&str>) -> String {
        match device {
            Some(d) => format!("{stream}/{d}"),
            None => stream.to_owned(),
        }
    }

    fn model_decision(
        action: Action,
        cfg: &RulesConfig,
        stream: &str,
        device: Option<&str>,
    ) -> Decision {
        let subj = subject(stream, device);
        let s = segments(&subj);
        if action == Action::Publish && stream.starts_with('$') {
            return Decision::SystemStream;
        }
        let denied = cfg.deny.iter().any(|p| {
            let p = segments(p);
            model_match(&p, &s, false, true)
                || (action == Action::Subscribe
                    && device.is_none()
                    && p.len() == 2
                    && model_match(&p[..1], &s, false, true))
                // A deny of the stream covers its devices, for either action.
                || (device.is_some() && model_match(&p, &segments(stream), false, true))
        });
        if denied {
            Decision::Denied
        } else if cfg
            .allow
            .iter()
            .any(|p| model_match(&segments(p), &s, true, true))
        {
            Decision::Allowed
        } else {
            Decision::NotAllowed
        }
    }

    /// Patterns over a small alphabet, invalid ones included (`a*`, empty segments, `>/x`).
    fn any_pattern() -> impl Strategy<Value = String> {
        let stream = prop_oneof![
            Just("a"),
            Just("b"),
            Just("$s"),
            Just("*"),
            Just(">"),
            Just("a*"),
            Just(""),
        ];
        let device = prop_oneof![
            Just(None),
            Just(Some("x")),
            Just(Some("x/y")),
            Just(Some("*")),
            Just(Some(">")),
            Just(Some("")),
            Just(Some("x>")),
        ];
        (stream, device).prop_map(|(s, d)| match d {
            Some(d) => format!("{s}/{d}"),
            None => s.to_string(),
        })
    }

    /// Valid patterns only, so that the matching property is not spent on compile errors.
    fn valid_pattern() -> impl Strategy<Value = String> {
        let stream = prop_oneof![Just("a"), Just("b"), Just("$s"), Just("*"), Just(">")];
        let device = prop_oneof![
            Just(None),
            Just(Some("x")),
            Just(Some("y")),
            Just(Some("x/y")),
            Just(Some("*")),
            Just(Some(">")),
        ];
        (stream, device).prop_map(|(s, d)| match d {
            Some(d) if s != ">" => format!("{s}/{d}"),
            _ => s.to_string(),
        })
    }

    fn subjects() -> impl Strategy<Value = (String, Option<String>)> {
        let stream = prop_oneof![Just("a"), Just("b"), Just("c"), Just("$s")];
        let device = prop_oneof![
            Just(None),
            Just(Some("x")),
            Just(Some("y")),
            Just(Some("x/y")),
            Just(Some("z")),
        ];
        (stream, device).prop_map(|(s, d)| (s.to_string(), d.map(str::to_string)))
    }

    proptest! {
        #[test]
        fn pattern_syntax_agrees_with_the_model(p in any_pattern()) {
            let compiled = Permissions::compile(&PermissionsConfig {
                publish: RulesConfig::default(),
                subscribe: RulesConfig { allow: vec![], deny: vec![p.clone()] },
            });
            prop_assert_eq!(compiled.is_ok(), model_valid(&p), "{}", p);
            if let Err(e) = compiled {
                let named = format!("`{}`", p);
                prop_assert!(e.to_string().contains(&named), "{}", e);
            }
        }

        #[test]
        fn compiled_matcher_agrees_with_the_model(
            allow in proptest::collection::vec(valid_pattern(), 0..4),
            deny in proptest::collection::vec(valid_pattern(), 0..3),
            probes in proptest::collection::vec(subjects(), 1..12),
        ) {
            let cfg = RulesConfig { allow, deny };
            let sub_perms = Permissions::compile(&PermissionsConfig {
                publish: RulesConfig::default(),
                subscribe: cfg.clone(),
            })
            .expect("valid patterns");
            // As publish rules the same lists are refused exactly when an allow pattern names a
            // system stream.
            let pub_perms = Permissions::compile(&PermissionsConfig {
                publish: cfg.clone(),
                subscribe: RulesConfig::default(),
            });
            let names_system = cfg.allow.iter().any(|p| segments(p)[0].starts_with('$'));
            prop_assert_eq!(pub_perms.is_err(), names_system);
            let mut cache = PublishCache::with_capacity(3);
            for (stream, device) in &probes {
                let device = device.as_deref();
                prop_assert_eq!(
                    sub_perms.subscribe(stream, device),
                    model_decision(Action::Subscribe, &cfg, stream, device),
                    "subscribe {} {:?}", stream, device
                );
                if let Ok(pub_perms) = &pub_perms {
                    let expected = model_decision(Action::Publish, &cfg, stream, device);
                    prop_assert_eq!(pub_perms.publish(stream, device), expected);
                    prop_assert_eq!(cache.decide(pub_perms, stream, device), expected);
                }
            }
        }
    }
}
