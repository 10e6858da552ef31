//! The sans-IO push session with authentication on, on a virtual clock: what a connection may do
//! before and after its token, when the token expires, how a fresh token is judged.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use powerhub::protocol::{Action, AuthPolicy, Session, SessionConfig};
use powerhub::security::auth::{AuthConfig, Authenticator};
use serde_json::{json, Value};

const SECRET: &str = "a shared secret of at least thirty-two bytes";

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

fn session(allow_reply_types: bool) -> Session {
    let config: AuthConfig = toml::from_str(&format!(
        r#"
        [[tokens]]
        token = "static-token"
        user = "svc"
        permissions = {{ publish = {{ allow = ["obs", "obs/>"] }}, subscribe = {{ allow = [">"] }} }}
        [jwt]
        algorithm = "HS256"
        secret = "{SECRET}"
        leeway_secs = 5
        "#
    ))
    .unwrap();
    let mut policy = AuthPolicy::new(Arc::new(Authenticator::from_config(&config).unwrap()));
    policy.allow_reply_types = allow_reply_types;
    Session::new(1, SessionConfig::default()).with_auth(policy)
}

fn jwt(sub: &str, exp: u64) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &json!({"sub": sub, "exp": exp, "permissions": {"subscribe": {"allow": ["obs"]}}}),
        &jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()),
    )
    .unwrap()
}

fn run(s: &mut Session, line: &str, now: SystemTime) -> Action {
    s.handle_line_at(&mut line.as_bytes().to_vec(), now)
}

fn reply(action: Action) -> Value {
    match action {
        Action::Reply(b) => serde_json::from_slice(&b).unwrap(),
        other => panic!("expected a reply, got {other:?}"),
    }
}

fn auth_line(token: &str) -> String {
    json!({"type":"auth","id":7,"token":token}).to_string()
}

#[test]
fn the_expiry_is_the_tokens_exp_plus_the_leeway_on_the_callers_clock() {
    let mut s = session(false);
    assert!(s.awaiting_auth());
    assert_eq!(s.expires_at(), None);
    let v = reply(run(&mut s, &auth_line(&jwt("alice", 1_000)), at(900)));
    assert_eq!(
        v,
        json!({"type":"authenticated","requestId":7,"user":"alice","expiresAt":1_005})
    );
    assert!(!s.awaiting_auth());
    assert_eq!(s.user(), Some("alice"));
    assert_eq!(s.expires_at(), Some(at(1_005)));
    // A fresh token moves it; a static token never expires.
    reply(run(&mut s, &auth_line(&jwt("alice", 2_000)), at(1_000)));
    assert_eq!(s.expires_at(), Some(at(2_005)));
    // A first token already past its expiry (with the leeway) closes the connection.
    let mut s = session(false);
    match run(&mut s, &auth_line(&jwt("alice", 1_000)), at(1_005)) {
        Action::CloseOnAuth {
            code, request_id, ..
        } => {
            assert_eq!(code, "token_expired");
            assert_eq!(request_id, Some(powerhub::protocol::RequestId::Int(7)));
        }
        other => panic!("{other:?}"),
    }
    assert!(s.awaiting_auth());
}

#[test]
fn a_refused_fresh_token_keeps_the_identity_in_force() {
    let mut s = session(false);
    reply(run(&mut s, &auth_line(&jwt("alice", 1_000)), at(900)));
    let v = reply(run(&mut s, &auth_line(&jwt("alice", 950)), at(960)));
    assert_eq!(v["code"], "token_expired");
    assert_eq!(s.expires_at(), Some(at(1_005)));
    let v = reply(run(&mut s, &auth_line("static-token"), at(960)));
    assert_eq!(v["code"], "user_mismatch");
    assert!(v["message"].as_str().unwrap().contains("`svc`"));
    assert_eq!(s.user(), Some("alice"));
}

#[test]
fn each_user_gets_the_permissions_of_its_token() {
    let mut s = session(false);
    reply(run(&mut s, &auth_line("static-token"), at(0)));
    let publish = r#"{"type":"publish","id":1,"message":{"type":"t","stream":"obs"}}"#;
    assert!(matches!(
        run(&mut s, publish, at(0)),
        Action::Publish { .. }
    ));
    // The JWT's claim grants subscribe to `obs` only.
    let mut s = session(false);
    reply(run(&mut s, &auth_line(&jwt("bob", 100)), at(0)));
    let v = reply(run(&mut s, publish, at(1)));
    assert_eq!(v["code"], "permission_denied", "{v}");
}

#[test]
fn reserved_types_are_refused_unless_allowed() {
    let publish = r#"{"type":"publish","id":1,"message":{"type":"frames_dropped","stream":"obs"}}"#;
    let mut s = session(false);
    reply(run(&mut s, &auth_line("static-token"), at(0)));
    assert_eq!(reply(run(&mut s, publish, at(0)))["code"], "reserved_type");
    let mut s = session(true);
    reply(run(&mut s, &auth_line("static-token"), at(0)));
    assert!(matches!(
        run(&mut s, publish, at(0)),
        Action::Publish { .. }
    ));
}

#[test]
fn a_handshake_token_is_an_auth_command_without_an_id() {
    let mut s = session(false);
    let v = reply(s.authenticate("static-token", at(0)));
    assert_eq!(
        v,
        json!({"type":"authenticated","user":"svc","expiresAt":null})
    );
    let mut s = session(false);
    match s.authenticate("nope", at(0)) {
        Action::CloseOnAuth {
            code, request_id, ..
        } => {
            assert_eq!(code, "unknown_token");
            assert_eq!(request_id, None);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_auth_command_is_parsed_strictly() {
    let mut s = session(false);
    let v = reply(run(&mut s, r#"{"type":"auth","id":1}"#, at(0)));
    assert_eq!(v["code"], "missing_field");
    let v = reply(run(&mut s, r#"{"type":"auth","id":1,"token":7}"#, at(0)));
    assert_eq!(v["code"], "wrong_type");
    let v = reply(run(
        &mut s,
        r#"{"type":"auth","id":1,"token":"a","token":"b"}"#,
        at(0),
    ));
    assert_eq!(v["code"], "duplicate_field");
    // The token never appears in a command's Debug output (commands are logged).
    let cmd = powerhub::protocol::parse_command(
        &mut br#"{"type":"auth","token":"sekrit-value"}"#.to_vec(),
    )
    .unwrap();
    assert!(!format!("{cmd:?}").contains("sekrit"), "{cmd:?}");
}

/// Before the token, a command that needs one is answered `auth_required` whatever its fields
/// hold, as when they are right; a line that is no command, and `auth`, `ping` and `pong`, get
/// their own errors.
#[test]
fn before_authentication_a_command_that_needs_it_is_refused_whatever_its_fields() {
    let mut s = session(false);
    for line in [
        r#"{"type":"publish","id":1,"message":{"type":"t","stream":"a/b"}}"#,
        r#"{"type":"publish","id":1,"message":{"type":"t","stream":""}}"#,
        r#"{"type":"publish","id":1,"message":{"type":"t"}}"#,
        r#"{"type":"publish","id":1,"message":{"type":"t","stream":"s","deviceId":""}}"#,
        r#"{"type":"publish","id":1,"message":{"type":"t","stream":"$stats"}}"#,
        r#"{"type":"subscribe","id":1,"stream":"a/b"}"#,
        r#"{"type":"subscribe","id":1}"#,
        r#"{"type":"unsubscribe","id":1}"#,
    ] {
        let r = reply(run(&mut s, line, at(0)));
        assert_eq!(
            (&r["code"], &r["requestId"]),
            (&json!("auth_required"), &json!(1)),
            "{line}: {r}"
        );
    }
    for (line, code) in [
        ("{not json", "invalid_json"),
        (r#"{"type":"nope","id":1}"#, "unknown_command"),
        (r#"{"type":"auth","id":1}"#, "missing_field"),
        (r#"{"type":"ping","id":1,"id":2}"#, "duplicate_field"),
    ] {
        let r = reply(run(&mut s, line, at(0)));
        assert_eq!(r["code"], code, "{line}: {r}");
    }
    // Once authenticated, the fields are judged.
    reply(run(&mut s, &auth_line("static-token"), at(0)));
    let r = reply(run(
        &mut s,
        r#"{"type":"subscribe","id":1,"stream":"a/b"}"#,
        at(0),
    ));
    assert_eq!(r["code"], "invalid_value", "{r}");
}

/// A push connection over `proto` with the session of `session(false)`, under the default
/// limits.
fn push_connection(
    proto: Box<dyn powerhub::plugin::StreamProtocol>,
    now: std::time::Instant,
) -> powerhub::push::PushConnection {
    push_connection_with(proto, powerhub::push::PushLimits::default(), now)
}

/// [`push_connection`] under `limits`.
fn push_connection_with(
    proto: Box<dyn powerhub::plugin::StreamProtocol>,
    limits: powerhub::push::PushLimits,
    now: std::time::Instant,
) -> powerhub::push::PushConnection {
    use powerhub::outbox::{OutboxConfig, PayloadFactory};
    use powerhub::push::{PushConfig, PushConnection};
    let config = Arc::new(
        PushConfig::new(limits, OutboxConfig::default(), Arc::new(PayloadFactory)).unwrap(),
    );
    PushConnection::new(proto, session(false), &config, now).unwrap()
}

/// What the connection has to say, written whole.
fn said(conn: &mut powerhub::push::PushConnection, now: std::time::Instant) -> String {
    let mut out = Vec::new();
    while let Some(t) = conn.poll_transmit(&mut out, 64, now) {
        let n = t.len();
        conn.on_written(t, n, now);
    }
    String::from_utf8(out.concat()).unwrap()
}

/// The start of a publish whose message is padded with `pad` bytes, unfinished.
fn unfinished_publish(pad: usize) -> String {
    format!(
        r#"{{"type":"publish","message":{{"type":"t","stream":"obs","pad":"{}"#,
        "x".repeat(pad)
    )
}

/// Feeds `long` (an unfinished message longer than the connection's pre-authentication limit,
/// more than 1000 bytes of it within) in two pieces cut at its 1000th byte: held after the
/// first, closed naming `max_unauthenticated_message_bytes` after the second. What the
/// connection said.
fn held_then_closed(
    conn: &mut powerhub::push::PushConnection,
    long: &str,
    now: std::time::Instant,
) -> String {
    conn.handle_input(&long.as_bytes()[..1000], now);
    assert_eq!(conn.poll(now, at(900)), None);
    assert_eq!(
        conn.close_reason(),
        None,
        "a short unfinished message is held"
    );
    conn.handle_input(&long.as_bytes()[1000..], now);
    assert_eq!(conn.poll(now, at(900)), None);
    assert_eq!(
        conn.close_reason(),
        Some("max_unauthenticated_message_bytes")
    );
    said(conn, now)
}

/// A command that arrives once the connection's token has expired is not handled: the
/// connection is closed with `token_expired` then, not at the driver's next timer tick (until
/// which a client pipelining right after the expiry still had its subscribes and publishes
/// handled).
#[test]
fn a_command_arriving_after_the_token_expired_closes_the_connection_unhandled() {
    use std::time::Instant;

    use powerhub::plugin::ProtocolFactory;
    use powerhub::push::Request;

    let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
    let now = Instant::now();
    let mut conn = push_connection(proto, now);
    conn.handle_input(
        format!("{}\n", auth_line(&jwt("alice", 1_000))).as_bytes(),
        now,
    );
    assert_eq!(conn.poll(now, at(900)), None);
    assert_eq!(conn.close_reason(), None);
    // Well past `exp` and its leeway; the timer has not run.
    conn.handle_input(
        b"{\"type\":\"subscribe\",\"id\":1,\"stream\":\"obs\"}\n{\"type\":\"ping\",\"id\":2}\n",
        now,
    );
    let asked = conn.poll(now, at(2_000));
    assert!(
        !matches!(asked, Some(Request::Subscribe { .. })),
        "the subscribe was handled: {asked:?}"
    );
    assert_eq!(conn.close_reason(), Some("token_expired"));
}

/// Before it authenticates, a connection holds at most
/// `push::MAX_UNAUTHENTICATED_MESSAGE_BYTES` of one unfinished message: past it the client is
/// told the limit and closed, so that clients that never authenticate cannot make the server
/// hold `max_message_bytes` each. An `auth` read with a long message behind it is handled
/// first, and an authenticated connection may send messages of any size up to
/// `max_message_bytes`.
#[test]
fn before_authentication_a_connection_holds_only_a_small_unfinished_message() {
    use std::time::Instant;

    use powerhub::plugin::ProtocolFactory;
    use powerhub::push::MAX_UNAUTHENTICATED_MESSAGE_BYTES;

    let now = Instant::now();
    let connect = || {
        push_connection(
            powerhub_ndjson::NdjsonFactory.new_connection(&Default::default()),
            now,
        )
    };
    let long = unfinished_publish(MAX_UNAUTHENTICATED_MESSAGE_BYTES);

    // Not authenticated: closed, told why.
    let words = held_then_closed(&mut connect(), &long, now);
    assert!(
        words.contains(r#""limit":"max_unauthenticated_message_bytes""#),
        "{words}"
    );

    // Authenticated in the same input, ahead of the long message: served.
    let mut conn = connect();
    conn.handle_input(
        format!("{}\n{long}", auth_line("static-token")).as_bytes(),
        now,
    );
    assert_eq!(conn.poll(now, at(900)), None);
    conn.handle_input(b"\"}}\n", now);
    let _ = conn.poll(now, at(900));
    assert_eq!(conn.close_reason(), None);
}

/// The limit is `limits.max_unauthenticated_message_bytes`: a server that sets it lower closes
/// a connection holding more than that, and says the value it set.
#[test]
fn the_unauthenticated_message_limit_is_the_configured_one() {
    use std::time::Instant;

    use powerhub::plugin::ProtocolFactory;
    use powerhub::push::PushLimits;

    let now = Instant::now();
    let limits = PushLimits::default().with_max_unauthenticated_message_bytes(1024);
    let connect = || {
        let proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
        push_connection_with(proto, limits.clone(), now)
    };
    let long = unfinished_publish(2000);
    let words = held_then_closed(&mut connect(), &long, now);
    assert!(
        words.contains("max_unauthenticated_message_bytes = 1024"),
        "{words}"
    );

    // Behind a command in the same input that does not authenticate: judged once that command
    // is answered, not at the next receive.
    let mut conn = connect();
    let input = format!("{{\"type\":\"ping\",\"id\":1}}\n{long}");
    conn.handle_input(input.as_bytes(), now);
    assert_eq!(conn.poll(now, at(900)), None);
    assert_eq!(
        conn.close_reason(),
        Some("max_unauthenticated_message_bytes")
    );
    let words = said(&mut conn, now);
    assert!(
        words.starts_with(r#"{"type":"pong","requestId":1}"#),
        "{words}"
    );
    assert!(
        words.contains(r#""limit":"max_unauthenticated_message_bytes""#),
        "{words}"
    );

    // The server's config sets it, and refuses 0 naming the key.
    let config = powerhub::runtime::Config::from_toml(
        "[limits]\nmax_unauthenticated_message_bytes = 1024\n",
        None,
    )
    .unwrap();
    assert_eq!(PushLimits::from_config(&config), limits);
    let err = powerhub::runtime::Config::from_toml(
        "[limits]\nmax_unauthenticated_message_bytes = 0\n",
        None,
    )
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("limits.max_unauthenticated_message_bytes"),
        "{err}"
    );
}

/// The same limit holds for a WebSocket message the protocol assembles itself from its frames:
/// 100 KB of an unfinished 200 KB text frame, before the client authenticates, closes it.
#[test]
fn before_authentication_a_websocket_holds_only_a_small_unfinished_message() {
    use std::time::Instant;

    use powerhub::plugin::ProtocolFactory;

    let now = Instant::now();
    let proto = powerhub_websocket::WebSocketFactory::new(Default::default())
        .unwrap()
        .new_connection(&Default::default());
    let mut conn = push_connection(proto, now);
    let mut bytes = b"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n\
        Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
        Sec-WebSocket-Version: 13\r\n\r\n"
        .to_vec();
    // A final text frame of 200 000 bytes, masked with zeros (the payload as it is).
    bytes.extend_from_slice(&[0x81, 0x80 | 127]);
    bytes.extend_from_slice(&200_000u64.to_be_bytes());
    bytes.extend_from_slice(&[0, 0, 0, 0]);
    bytes.extend_from_slice(&[b' '; 100_000]);
    conn.handle_input(&bytes, now);
    assert_eq!(conn.poll(now, at(900)), None);
    assert_eq!(
        conn.close_reason(),
        Some("max_unauthenticated_message_bytes")
    );

    // The opening handshake is not a message: `max_handshake_bytes` bounds it, so even a limit
    // of one byte lets an upgrade arriving in pieces complete.
    let proto = powerhub_websocket::WebSocketFactory::new(Default::default())
        .unwrap()
        .new_connection(&Default::default());
    let limits = powerhub::push::PushLimits::default().with_max_unauthenticated_message_bytes(1);
    let mut conn = push_connection_with(proto, limits, now);
    let handshake = &bytes[..bytes.iter().position(|&b| b == 0x81).unwrap()];
    for piece in handshake.chunks(20) {
        conn.handle_input(piece, now);
        assert_eq!(conn.poll(now, at(900)), None);
        assert_eq!(conn.close_reason(), None);
    }
    let words = said(&mut conn, now);
    assert!(words.starts_with("HTTP/1.1 101"), "{words}");
}
