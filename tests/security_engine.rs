//! Authentication, permissions, system streams and origins, through `Engine` on real loopback
//! sockets, on both backends: what a client of a server with an `[auth]` section sees
//! (docs/security.md).

mod engine_support;

use std::net::TcpStream;
use std::time::Duration;

use engine_support::*;
use powerhub::runtime::{BackendChoice, Config, Engine};
use powerhub::security::auth::AuthConfig;
use serde_json::{json, Value};

const SECRET: &str = "a shared secret of at least thirty-two bytes";

/// Static tokens for a reader of `obs` and `$stats`, a publisher to `obs` (not `obs/secret`),
/// a user with no permissions; HS256 JWTs with audience `powerhub`.
fn auth_section(extra: &str) -> AuthConfig {
    toml::from_str(&format!(
        r#"
        {extra}
        [[tokens]]
        token = "reader-token"
        user = "reader"
        permissions = {{ subscribe = {{ allow = ["obs", "obs/*", "$stats"] }} }}

        [[tokens]]
        token = "writer-token"
        user = "writer"
        permissions = {{ publish = {{ allow = ["obs", "obs/>"], deny = ["obs/secret"] }}, subscribe = {{ allow = ["obs/*"], deny = ["obs/secret"] }} }}

        [[tokens]]
        token = "nobody-token"
        user = "nobody"

        [jwt]
        algorithm = "HS256"
        secret = "{SECRET}"
        audience = "powerhub"
        "#
    ))
    .expect("valid [auth]")
}

fn auth_config(backend: BackendChoice, extra: &str) -> Config {
    let mut c = base_config(backend);
    c.auth = Some(auth_section(extra));
    c
}

/// An HS256 JWT with `claims`, signed with `secret`.
fn jwt(claims: Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256),
        &claims,
        &jsonwebtoken::EncodingKey::from_secret(secret.as_bytes()),
    )
    .unwrap()
}

fn auth(c: &mut Client, token: &str) -> Value {
    c.send(&json!({"type":"auth","id":"a","token":token}).to_string());
    c.msg()
}

fn authed(addr: std::net::SocketAddr, token: &str) -> Client {
    let mut c = Client::connect(addr);
    let v = auth(&mut c, token);
    assert_eq!(v["type"], "authenticated", "{v}");
    c
}

/// Reads until end of stream (a keepalive ping may come first); asserts the connection closed.
fn assert_closed(c: &mut Client) {
    let rest = c.rest();
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.lines().all(|l| l.contains(r#""type":"ping""#)),
        "nothing but keepalive before the close: {text}"
    );
}

#[test]
fn until_a_token_verifies_only_auth_ping_and_pong_are_accepted() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let mut c = Client::connect(server.addr);
        for cmd in [
            r#"{"type":"subscribe","id":1,"stream":"obs"}"#,
            r#"{"type":"publish","id":2,"message":{"type":"t","stream":"obs"}}"#,
            r#"{"type":"unsubscribe","id":3,"subscriptionId":"x"}"#,
        ] {
            c.send(cmd);
            let v = c.msg();
            assert_eq!(v["code"], "auth_required", "{cmd}: {v}");
            assert!(v["message"].as_str().unwrap().contains("\"auth\""), "{v}");
        }
        c.send(r#"{"type":"ping","id":4}"#);
        assert_eq!(c.msg(), json!({"type":"pong","requestId":4}));
        let v = auth(&mut c, "reader-token");
        assert_eq!(
            v,
            json!({"type":"authenticated","requestId":"a","user":"reader","expiresAt":null})
        );
        c.send(r#"{"type":"subscribe","id":5,"stream":"obs"}"#);
        assert_eq!(c.msg()["type"], "subscribed");
    });
}

#[test]
fn a_refused_first_token_is_named_and_the_connection_closes() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let now = unix_now();
        let good = json!({"sub":"alice","aud":"powerhub","exp":now + 600});
        let cases = [
            ("not-a-token".to_owned(), "unknown_token"),
            (
                jwt(good.clone(), "another secret of at least thirty-two bytes!"),
                "bad_signature",
            ),
            (
                jwt(
                    json!({"sub":"alice","aud":"powerhub","exp":now - 10}),
                    SECRET,
                ),
                "token_expired",
            ),
            (
                jwt(
                    json!({"sub":"alice","aud":"powerhub","nbf":now + 600}),
                    SECRET,
                ),
                "token_not_yet_valid",
            ),
            (
                jwt(
                    json!({"sub":"alice","aud":"elsewhere","exp":now + 600}),
                    SECRET,
                ),
                "wrong_audience",
            ),
            ("a.b.c".to_owned(), "malformed_token"),
            (
                // {"alg":"none","typ":"JWT"} . {"sub":"alice"} . (no signature)
                "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJhbGljZSJ9.".to_owned(),
                "alg_none",
            ),
        ];
        for (token, code) in cases {
            let mut c = Client::connect(server.addr);
            let v = auth(&mut c, &token);
            assert_eq!(v["type"], "error", "{code}: {v}");
            assert_eq!(v["code"], code, "{v}");
            assert_eq!(v["requestId"], "a", "{v}");
            assert!(
                !v["message"].as_str().unwrap().contains(&token),
                "the message never repeats the token: {v}"
            );
            assert_closed(&mut c);
        }
        // The server is unharmed.
        let mut c = authed(server.addr, "reader-token");
        c.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(c.msg()["type"], "pong");
    });
}

#[test]
fn a_jwt_authenticates_with_the_permissions_of_its_claim() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let exp = unix_now() + 600;
        let token = jwt(
            json!({"sub":"alice","aud":"powerhub","exp":exp,
                   "permissions":{"publish":{"allow":["obs/>"]}}}),
            SECRET,
        );
        let mut c = Client::connect(server.addr);
        assert_eq!(
            auth(&mut c, &token),
            json!({"type":"authenticated","requestId":"a","user":"alice","expiresAt":exp})
        );
        c.send(
            r#"{"type":"publish","id":1,"message":{"type":"t","stream":"obs","deviceId":"d1"}}"#,
        );
        assert_eq!(c.msg()["type"], "published");
        c.send(r#"{"type":"subscribe","id":2,"stream":"obs"}"#);
        assert_eq!(c.msg()["code"], "permission_denied");
    });
}

#[test]
fn permission_denials_are_named_and_the_connection_stays() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let mut w = authed(server.addr, "writer-token");
        // Deny wins over allow; what no allow pattern matches is refused.
        let cases = [
            (
                r#"{"type":"publish","id":1,"message":{"type":"t","stream":"obs","deviceId":"secret"}}"#,
                "publish to stream `obs` device `secret` is not permitted: a deny pattern matches",
            ),
            (
                r#"{"type":"publish","id":2,"message":{"type":"t","stream":"other"}}"#,
                "publish to stream `other` is not permitted: no allow pattern matches",
            ),
            (
                r#"{"type":"subscribe","id":3,"stream":"obs","deviceId":"secret"}"#,
                "subscribe to stream `obs` device `secret` is not permitted: a deny pattern matches",
            ),
            (
                // A whole-stream subscription would receive the denied device's messages.
                r#"{"type":"subscribe","id":4,"stream":"obs"}"#,
                "subscribe to stream `obs` is not permitted: a deny pattern matches",
            ),
        ];
        for (cmd, message) in cases {
            w.send(cmd);
            let v = w.msg();
            assert_eq!(v["code"], "permission_denied", "{cmd}: {v}");
            assert_eq!(v["message"], message, "{v}");
        }
        // Allowed ones, twice each (the second from the connection's cache of decisions).
        let mut r = authed(server.addr, "reader-token");
        r.send(r#"{"type":"subscribe","id":1,"stream":"obs","deviceId":"d1"}"#);
        assert_eq!(r.msg()["type"], "subscribed");
        for id in [5, 6] {
            w.send(&format!(
                r#"{{"type":"publish","id":{id},"message":{{"type":"t","stream":"obs","deviceId":"d1","n":{id}}}}}"#
            ));
            assert_eq!(
                w.msg(),
                json!({"type":"published","requestId":id,"delivered":1})
            );
            assert_eq!(r.msg()["n"], id);
        }
        // A user with no permissions may do nothing, and stays connected.
        let mut n = authed(server.addr, "nobody-token");
        n.send(r#"{"type":"subscribe","id":1,"stream":"obs","deviceId":"d1"}"#);
        assert_eq!(n.msg()["code"], "permission_denied");
        n.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(n.msg()["type"], "pong");
    });
}

#[test]
fn system_streams_are_the_servers_and_reading_stats_needs_its_own_permission() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let mut w = authed(server.addr, "writer-token");
        w.send(r#"{"type":"subscribe","id":1,"stream":"$stats"}"#);
        assert_eq!(w.msg()["code"], "permission_denied");
        w.send(r#"{"type":"publish","id":2,"message":{"type":"stats","stream":"$stats","subscribers":999999}}"#);
        let v = w.msg();
        assert_eq!(v["code"], "invalid_value", "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("message.stream"),
            "{v}"
        );
        let mut r = authed(server.addr, "reader-token");
        r.send(r#"{"type":"subscribe","id":1,"stream":"$stats"}"#);
        assert_eq!(r.msg()["type"], "subscribed");
    });
}

#[test]
fn a_published_message_cannot_pass_for_a_server_reply() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let mut w = authed(server.addr, "writer-token");
        for kind in powerhub::protocol::RESERVED_MESSAGE_TYPES {
            w.send(&format!(
                r#"{{"type":"publish","id":1,"message":{{"type":"{kind}","stream":"obs"}}}}"#
            ));
            let v = w.msg();
            assert_eq!(v["code"], "reserved_type", "{kind}: {v}");
            assert!(v["message"].as_str().unwrap().contains("allow_reply_types"));
        }
        drop(server);
        let server = start(auth_config(backend, "allow_reply_types = true"));
        let mut w = authed(server.addr, "writer-token");
        w.send(r#"{"type":"publish","id":1,"message":{"type":"error","stream":"obs"}}"#);
        assert_eq!(w.msg()["type"], "published");
    });
}

#[test]
fn without_auth_every_client_may_do_everything_but_publish_to_system_streams() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        c.send(r#"{"type":"subscribe","id":1,"stream":"$stats"}"#);
        assert_eq!(c.msg()["type"], "subscribed");
        // The spec's FIFO types include errors and pings: forwarded as published.
        c.send(r#"{"type":"publish","id":2,"message":{"type":"error","stream":"obs"}}"#);
        assert_eq!(c.msg()["type"], "published");
        // A client that always authenticates still works.
        assert_eq!(
            auth(&mut c, "anything"),
            json!({"type":"authenticated","requestId":"a","user":"anonymous","expiresAt":null})
        );
    });
}

#[test]
fn a_connection_is_closed_when_its_token_expires_unless_it_sent_a_fresh_one() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let token = |secs: u64| {
            jwt(
                json!({"sub":"alice","aud":"powerhub","exp":unix_now() + secs,
                       "permissions":{"subscribe":{"allow":["obs"]}}}),
                SECRET,
            )
        };
        // Expires in a second: closed then, with the code, after what was queued.
        let mut c = Client::connect(server.addr);
        assert_eq!(auth(&mut c, &token(1))["type"], "authenticated");
        let v = c.msg();
        assert_eq!(v["code"], "token_expired", "{v}");
        assert!(v["message"].as_str().unwrap().contains("alice"), "{v}");
        assert_closed(&mut c);

        // Refreshed before: still open after the first expiry.
        let mut c = Client::connect(server.addr);
        assert_eq!(auth(&mut c, &token(1))["type"], "authenticated");
        assert_eq!(auth(&mut c, &token(600))["type"], "authenticated");
        std::thread::sleep(Duration::from_millis(2_500));
        c.send(r#"{"type":"ping","id":9}"#);
        assert_eq!(c.msg(), json!({"type":"pong","requestId":9}));

        // A fresh token for another user is refused; the connection keeps its user.
        let v = auth(&mut c, "reader-token");
        assert_eq!(v["code"], "user_mismatch", "{v}");
        c.send(r#"{"type":"subscribe","id":1,"stream":"obs"}"#);
        assert_eq!(c.msg()["type"], "subscribed");
        // A refused fresh token leaves it authenticated.
        let v = auth(&mut c, "not-a-token");
        assert_eq!(v["code"], "unknown_token", "{v}");
        c.send(r#"{"type":"ping","id":10}"#);
        assert_eq!(c.msg()["type"], "pong");
    });
}

/// `[auth.jwt] require_exp`: a first JWT without `exp` is refused with `missing_exp` and the
/// connection closed; a fresh one without `exp` on an authenticated connection is refused and
/// the connection keeps its token; JWTs with `exp`, and static tokens, pass.
#[test]
fn with_require_exp_a_jwt_without_exp_is_refused_as_missing_exp() {
    on_both_backends(|backend| {
        let mut config = auth_config(backend, "");
        let jwt_config = config.auth.as_mut().and_then(|a| a.jwt.as_mut());
        jwt_config.expect("[auth.jwt]").require_exp = true;
        let server = start(config);
        let no_exp = jwt(json!({"sub":"alice","aud":"powerhub"}), SECRET);
        let with_exp = jwt(
            json!({"sub":"alice","aud":"powerhub","exp":unix_now() + 600}),
            SECRET,
        );

        let mut c = Client::connect(server.addr);
        let v = auth(&mut c, &no_exp);
        assert_eq!(v["code"], "missing_exp", "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("require_exp"),
            "{v}"
        );
        assert_closed(&mut c);

        let mut c = Client::connect(server.addr);
        assert_eq!(auth(&mut c, &with_exp)["type"], "authenticated");
        let v = auth(&mut c, &no_exp);
        assert_eq!(v["code"], "missing_exp", "{v}");
        c.send(r#"{"type":"ping","id":9}"#);
        assert_eq!(c.msg(), json!({"type":"pong","requestId":9}));

        let mut c = Client::connect(server.addr);
        assert_eq!(auth(&mut c, "reader-token")["type"], "authenticated");
    });
}

#[test]
fn the_first_message_deadline_closes_a_connection_that_does_not_authenticate() {
    on_both_backends(|backend| {
        let mut config = auth_config(backend, "");
        config.limits.first_message_timeout_ms = 300;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        // A ping is a message, but not an authentication.
        c.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(c.msg()["type"], "pong");
        let v = c.msg();
        assert_eq!(v["code"], "limit_exceeded", "{v}");
        assert_eq!(v["limit"], "first_message_timeout_ms", "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("not authenticated"),
            "{v}"
        );
        assert_closed(&mut c);
        // An authenticated connection is past the deadline for good.
        let mut c = authed(server.addr, "reader-token");
        std::thread::sleep(Duration::from_millis(600));
        c.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(c.msg()["type"], "pong");
    });
}

#[test]
fn a_reload_changes_the_tokens_of_connections_accepted_after_it() {
    on_both_backends(|backend| {
        let server = start(auth_config(backend, ""));
        let mut old = authed(server.addr, "reader-token");
        let fresh: AuthConfig = toml::from_str(
            r#"
            [[tokens]]
            token = "rotated-token"
            user = "reader"
            permissions = { subscribe = { allow = ["obs"] } }
            "#,
        )
        .unwrap();
        server.engine.reload_auth(Some(&fresh)).unwrap();
        let mut c = Client::connect(server.addr);
        assert_eq!(auth(&mut c, "reader-token")["code"], "unknown_token");
        authed(server.addr, "rotated-token");
        // The open connection keeps its identity.
        old.send(r#"{"type":"subscribe","id":1,"stream":"$stats"}"#);
        assert_eq!(old.msg()["type"], "subscribed");
        // Authentication cannot be switched off by a reload.
        let err = server.engine.reload_auth(None).unwrap_err();
        assert!(err.to_string().contains("auth"), "{err}");
    });
}

// ---- WebSocket: tokens in the handshake, origins ----

fn websocket_config(backend: BackendChoice, origins: Option<Vec<&str>>) -> Config {
    let mut c = auth_config(backend, "");
    let mut l = powerhub::runtime::ListenerConfig::tcp("websocket", "127.0.0.1:0");
    l.allowed_origins = origins.map(|o| o.into_iter().map(String::from).collect());
    c.listeners = vec![l];
    c
}

fn ws_server(config: Config) -> Server {
    let mut registry = powerhub::runtime::ProtocolRegistry::with_builtins();
    let ws =
        powerhub_websocket::WebSocketFactory::new(powerhub_websocket::WebSocketConfig::default())
            .unwrap();
    registry.register(std::sync::Arc::new(ws)).unwrap();
    start_with(config, &registry)
}

type Ws = tungstenite::WebSocket<TcpStream>;

/// Opens a WebSocket to `path` with extra headers; the HTTP status of a refused upgrade.
fn ws_connect(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Result<Ws, u16> {
    use tungstenite::client::IntoClientRequest;
    let mut request = format!("ws://{addr}{path}").into_client_request().unwrap();
    for (k, v) in headers {
        request.headers_mut().insert(
            tungstenite::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    let stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    match tungstenite::client(request, stream) {
        Ok((ws, _)) => Ok(ws),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(r))) => {
            Err(r.status().as_u16())
        }
        Err(e) => panic!("handshake: {e}"),
    }
}

fn ws_json(ws: &mut Ws) -> Value {
    loop {
        match ws.read().expect("a message") {
            tungstenite::Message::Text(t) => return serde_json::from_str(t.as_str()).unwrap(),
            tungstenite::Message::Ping(_) | tungstenite::Message::Pong(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn a_websocket_client_may_authenticate_in_its_handshake() {
    on_both_backends(|backend| {
        let server = ws_server(websocket_config(backend, None));
        let mut ws = ws_connect(
            server.addr,
            "/",
            &[("Authorization", "Bearer reader-token")],
        )
        .expect("upgraded");
        assert_eq!(
            ws_json(&mut ws),
            json!({"type":"authenticated","user":"reader","expiresAt":null})
        );
        ws.send(tungstenite::Message::text(
            r#"{"type":"subscribe","id":1,"stream":"obs"}"#,
        ))
        .unwrap();
        assert_eq!(ws_json(&mut ws)["type"], "subscribed");

        // Browsers cannot set headers: the `token` query parameter, percent-encoded.
        let token = jwt(
            json!({"sub":"browser user","aud":"powerhub","exp":unix_now() + 600}),
            SECRET,
        );
        let mut ws = ws_connect(server.addr, &format!("/?v=1&token={token}"), &[]).unwrap();
        assert_eq!(ws_json(&mut ws)["user"], "browser user");

        // A refused handshake token: the named error, then close 1008.
        let mut ws = ws_connect(server.addr, "/?token=wrong%2Dtoken", &[]).unwrap();
        assert_eq!(ws_json(&mut ws)["code"], "unknown_token");
        match ws.read() {
            Ok(tungstenite::Message::Close(Some(frame))) => {
                assert_eq!(u16::from(frame.code), 1008, "{frame:?}")
            }
            other => panic!("expected a close frame, got {other:?}"),
        }
    });
}

#[test]
fn with_auth_on_a_websocket_listener_accepts_only_its_own_origin_by_default() {
    on_both_backends(|backend| {
        let server = ws_server(websocket_config(backend, None));
        let own = format!("http://{}", server.addr);
        for (origin, status) in [
            ("http://evil.example", Some(403)),
            ("null", Some(403)),
            (own.as_str(), None),
        ] {
            let result = ws_connect(server.addr, "/", &[("Origin", origin)]);
            assert_eq!(result.err(), status, "Origin: {origin}");
        }
        // Programs send no Origin: accepted (they still need a token).
        assert!(ws_connect(server.addr, "/", &[]).is_ok());
    });
}

#[test]
fn allowed_origins_lists_the_origins_a_websocket_listener_accepts() {
    on_both_backends(|backend| {
        let server = ws_server(websocket_config(
            backend,
            Some(vec!["https://app.example", "null"]),
        ));
        for (origin, status) in [
            ("https://app.example", None),
            ("HTTPS://APP.EXAMPLE", None),
            ("null", None),
            ("http://evil.example", Some(403)),
            ("https://app.example.evil", Some(403)),
        ] {
            let result = ws_connect(server.addr, "/", &[("Origin", origin)]);
            assert_eq!(result.err(), status, "Origin: {origin}");
        }
        drop(server);
        let server = ws_server(websocket_config(backend, Some(vec!["*"])));
        assert!(ws_connect(server.addr, "/", &[("Origin", "http://any.example")]).is_ok());
        drop(server);
        let err = match Engine::start(websocket_config(backend, Some(vec!["not an origin"])), &{
            let mut r = powerhub::runtime::ProtocolRegistry::with_builtins();
            r.register(std::sync::Arc::new(
                powerhub_websocket::WebSocketFactory::new(Default::default()).unwrap(),
            ))
            .unwrap();
            r
        }) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("an invalid origin must be refused"),
        };
        assert!(
            err.contains("listener[0]") && err.contains("allowed_origins"),
            "{err}"
        );
    });
}

// ---- Limits per connection and per user ----

/// `n` publish commands to `obs` in one string, with ids when `ids`.
fn publishes(n: u64, ids: bool) -> String {
    (0..n)
        .map(|seq| match ids {
            true => format!(
                "{{\"type\":\"publish\",\"id\":{seq},\"message\":{}}}\n",
                message("obs", seq, 10)
            ),
            false => format!(
                "{{\"type\":\"publish\",\"message\":{}}}\n",
                message("obs", seq, 10)
            ),
        })
        .collect()
}

/// Reads the replies to `n` publishes with ids: how many were published and how many refused,
/// each refusal a `limit_exceeded` naming `limit`.
fn published_and_refused(c: &mut Client, n: u64, limit: &str) -> (u64, u64) {
    let (mut published, mut refused) = (0, 0);
    for _ in 0..n {
        let v = c.msg();
        match v["type"].as_str() {
            Some("published") => published += 1,
            _ => {
                assert_eq!(v["code"], "limit_exceeded", "{v}");
                assert_eq!(v["limit"], limit, "{v}");
                refused += 1;
            }
        }
    }
    (published, refused)
}

#[test]
fn a_publisher_over_its_rate_is_refused_by_name_and_closed_after_repeated_violations() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.publish_messages_per_second = 100;
        config.limits.publish_violations_before_close = 50;
        let server = start(config);
        let mut sub = Client::connect(server.addr);
        sub.subscribe("obs");
        let mut c = Client::connect(server.addr);
        // One write of 120 publishes: the bucket holds one second's worth, 100.
        c.send_raw(publishes(120, true).as_bytes());
        let (published, refused) =
            published_and_refused(&mut c, 120, "publish_messages_per_second");
        // The bucket refills while the 120 are read: at least 100 pass, and most of the rest
        // is refused.
        assert!(
            published >= 100 && refused >= 1,
            "{published} published, {refused} refused"
        );
        for _ in 0..published {
            assert_eq!(sub.msg()["type"], "tick");
        }
        // Each refusal is a limit error in the engine's stats, though the connection stays.
        eventually("each refusal is counted", || {
            server.engine.stats().limit_errors >= refused
        });
        // 200 more at once: the 50th refusal in a row closes the connection, naming the limit.
        c.send_raw(publishes(200, false).as_bytes());
        let mut last = Value::Null;
        while let Some(line) = c.line() {
            last = serde_json::from_str(&line).unwrap();
        }
        assert_eq!(last["limit"], "publish_messages_per_second", "{last}");
        assert!(
            last["message"]
                .as_str()
                .unwrap()
                .contains("publish_violations_before_close"),
            "{last}"
        );
    });
}

#[test]
fn a_users_publish_rate_is_shared_by_its_connections_and_not_by_other_users() {
    on_both_backends(|backend| {
        let mut config = auth_config(backend, "publish_messages_per_second_per_user = 100");
        config.engine.shards = 2;
        let server = start(config);
        // Two connections of one user (on both shards, as the engine spreads them) and one of
        // another user, each writing 150 publishes at once.
        let mut conns = [
            authed(server.addr, "writer-token"),
            authed(server.addr, "writer-token"),
        ];
        let ingest = jwt(
            json!({"sub":"ingest","aud":"powerhub","exp":unix_now() + 600,
                   "permissions":{"publish":{"allow":["obs"]}}}),
            SECRET,
        );
        let mut other = authed(server.addr, &ingest);
        let batch = publishes(150, true);
        let started = std::time::Instant::now();
        for c in &mut conns {
            c.send_raw(batch.as_bytes());
        }
        let (mut published, mut refused) = (0u64, 0u64);
        for c in &mut conns {
            let (p, r) = published_and_refused(c, 150, "publish_messages_per_second_per_user");
            published += p;
            refused += r;
        }
        let elapsed = started.elapsed().as_secs_f64();
        // One second's worth at once, then the refill while the replies were read: never the
        // 300 the two connections asked for.
        let most = 100 + (100.0 * elapsed).ceil() as u64;
        assert!(
            (100..=most).contains(&published) && refused > 0,
            "{published} published, {refused} refused in {elapsed:.3} s (at most {most})"
        );
        // The other user has a bucket of its own: a full one.
        let half = publishes(75, true);
        other.send_raw(half.as_bytes());
        for _ in 0..75 {
            assert_eq!(other.msg()["type"], "published");
        }
    });
}

/// A user's publish budget outlives its connections: a user that spent it, closed its last
/// connection and came back finds it as it left it, refilling at its rate, not full again.
/// (Its entry went with its last connection, so each reconnect refilled the bucket, and one
/// connection at a time could publish a second's worth per reconnect.)
#[test]
fn a_users_publish_budget_is_not_refilled_by_reconnecting() {
    on_both_backends(|backend| {
        let config = auth_config(backend, "publish_messages_per_second_per_user = 100");
        let server = start(config);
        let started = std::time::Instant::now();
        let mut first = authed(server.addr, "writer-token");
        first.send_raw(publishes(100, true).as_bytes());
        let (before, _) =
            published_and_refused(&mut first, 100, "publish_messages_per_second_per_user");
        drop(first);
        eventually("the first connection is gone", || {
            server.engine.stats().open_connections == 0
        });
        let mut again = authed(server.addr, "writer-token");
        again.send_raw(publishes(60, true).as_bytes());
        let (after, refused) =
            published_and_refused(&mut again, 60, "publish_messages_per_second_per_user");
        let elapsed = started.elapsed().as_secs_f64();
        let most = 100 + (100.0 * elapsed).ceil() as u64;
        assert!(
            before + after <= most,
            "{backend:?}: {before} then {after} published ({refused} refused) in {elapsed:.3} s: \
             at most {most}"
        );
    });
}

#[test]
fn a_token_may_give_its_user_publish_rates_of_its_own() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.auth = Some(
            toml::from_str(
                r#"
                publish_messages_per_second_per_user = 1000
                [[tokens]]
                token = "sensor-token"
                user = "sensor"
                permissions = { publish = { allow = ["obs", "obs/>"] } }
                rates = { publish_messages_per_second = 10 }
                [[tokens]]
                token = "service-token"
                user = "service"
                permissions = { publish = { allow = ["obs", "obs/>"] } }
                "#,
            )
            .expect("a valid [auth]"),
        );
        let server = start(config);
        let batch = publishes(50, true);
        let count = |token: &str| {
            let mut c = authed(server.addr, token);
            let started = std::time::Instant::now();
            c.send_raw(batch.as_bytes());
            let (published, _) =
                published_and_refused(&mut c, 50, "publish_messages_per_second_per_user");
            (published, started.elapsed().as_secs_f64())
        };
        // The sensor's own 10/s: one second's worth at once, then the refill.
        let (sensor, secs) = count("sensor-token");
        assert!(
            (10..=10 + (10.0 * secs).ceil() as u64).contains(&sensor),
            "{sensor} in {secs:.3} s"
        );
        // The service has the [auth] default, 1 000/s: all 50.
        assert_eq!(count("service-token").0, 50);
    });
}

#[test]
fn connections_and_subscriptions_per_user_are_bounded() {
    on_both_backends(|backend| {
        let mut config = auth_config(
            backend,
            "max_connections_per_user = 2\nmax_subscriptions_per_user = 3",
        );
        config.engine.shards = 2;
        let server = start(config);
        let mut a = authed(server.addr, "reader-token");
        let mut b = authed(server.addr, "reader-token");
        let mut third = Client::connect(server.addr);
        let v = auth(&mut third, "reader-token");
        assert_eq!(v["limit"], "max_connections_per_user", "{v}");
        assert_closed(&mut third);
        // Another user is not counted with this one.
        authed(server.addr, "writer-token");
        // Three subscriptions across the user's two connections, not four.
        for (on_a, device) in [(true, "d1"), (false, "d2"), (true, "d3")] {
            let c = if on_a { &mut a } else { &mut b };
            c.send(&format!(
                r#"{{"type":"subscribe","id":1,"stream":"obs","deviceId":"{device}"}}"#
            ));
            assert_eq!(c.msg()["type"], "subscribed");
        }
        b.send(r#"{"type":"subscribe","id":2,"stream":"obs","deviceId":"d4"}"#);
        let v = b.msg();
        assert_eq!(v["limit"], "max_subscriptions_per_user", "{v}");
        // An unsubscribe frees one; a closed connection frees its own and its slot.
        a.send(r#"{"type":"unsubscribe","id":3,"subscriptionId":"obs-1"}"#);
        assert_eq!(a.msg()["type"], "unsubscribed");
        b.send(r#"{"type":"subscribe","id":4,"stream":"obs","deviceId":"d4"}"#);
        assert_eq!(b.msg()["type"], "subscribed");
        drop(a);
        let mut again = Client::connect(server.addr);
        eventually("the closed connection's slot is free", || {
            let v = auth(&mut again, "reader-token");
            if v["type"] == "authenticated" {
                return true;
            }
            again = Client::connect(server.addr);
            false
        });
        again.send(r#"{"type":"subscribe","id":5,"stream":"obs","deviceId":"d5"}"#);
        assert_eq!(again.msg()["type"], "subscribed");
    });
}

/// A connection the server closes (here: a line over `max_message_bytes`) gives its user's
/// counts back when the close begins, not when its peer finally closes too: the user's next
/// connection, made while the closed one's client still holds its socket open, is accepted.
#[test]
fn a_connection_the_server_closes_frees_its_users_counts_at_once() {
    on_both_backends(|backend| {
        let mut config = auth_config(
            backend,
            "max_connections_per_user = 1\nmax_subscriptions_per_user = 1",
        );
        config.limits.max_message_bytes = 1024;
        let server = start(config);
        let mut first = authed(server.addr, "reader-token");
        first.send(r#"{"type":"subscribe","id":1,"stream":"obs"}"#);
        assert_eq!(first.msg()["type"], "subscribed");
        first.send(&"x".repeat(2048));
        let v = first.msg();
        assert_eq!(v["limit"], "max_message_bytes", "{v}");
        // `first`'s socket stays open on this side.
        let mut next = authed(server.addr, "reader-token");
        next.send(r#"{"type":"subscribe","id":2,"stream":"obs"}"#);
        assert_eq!(next.msg()["type"], "subscribed");
        drop(first);
    });
}

#[test]
fn a_token_may_give_its_user_connection_and_subscription_limits_of_its_own() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.auth = Some(
            toml::from_str(&format!(
                r#"
                max_connections_per_user = 3
                max_subscriptions_per_user = 3
                [[tokens]]
                token = "kiosk-token"
                user = "kiosk"
                permissions = {{ subscribe = {{ allow = ["obs/*"] }} }}
                limits = {{ max_connections = 1, max_subscriptions = 1 }}
                [[tokens]]
                token = "dashboard-token"
                user = "dashboard"
                permissions = {{ subscribe = {{ allow = ["obs/*"] }} }}
                limits = {{ max_subscriptions = 0 }}
                [jwt]
                algorithm = "HS256"
                secret = "{SECRET}"
                "#
            ))
            .expect("a valid [auth]"),
        );
        let server = start(config);
        let subscribe = |c: &mut Client, device: &str| {
            c.send(&format!(
                r#"{{"type":"subscribe","id":1,"stream":"obs","deviceId":"{device}"}}"#
            ));
            c.msg()
        };

        // The kiosk's own limits: one connection, one subscription.
        let mut kiosk = authed(server.addr, "kiosk-token");
        assert_eq!(subscribe(&mut kiosk, "d1")["type"], "subscribed");
        let v = subscribe(&mut kiosk, "d2");
        assert_eq!(v["limit"], "max_subscriptions_per_user", "{v}");
        assert!(
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("= 1 ") && m.contains("limits.max_subscriptions")),
            "{v}"
        );
        let mut second = Client::connect(server.addr);
        let v = auth(&mut second, "kiosk-token");
        assert_eq!(v["limit"], "max_connections_per_user", "{v}");
        assert_closed(&mut second);

        // The dashboard: the [auth] default of 3 connections, and no subscription limit.
        let mut dashboards: Vec<Client> = (0..3)
            .map(|_| authed(server.addr, "dashboard-token"))
            .collect();
        for n in 0..5 {
            let v = subscribe(&mut dashboards[0], &format!("d{n}"));
            assert_eq!(v["type"], "subscribed", "{v}");
        }
        let mut fourth = Client::connect(server.addr);
        let v = auth(&mut fourth, "dashboard-token");
        assert_eq!(v["limit"], "max_connections_per_user", "{v}");

        // A JWT gives them in its `limits` claim; a claim of another shape is refused by name.
        let token = jwt(
            json!({"sub":"jwt-user","exp":unix_now() + 600,"permissions":{"subscribe":{"allow":["obs/*"]}},"limits":{"max_subscriptions":2}}),
            SECRET,
        );
        let mut j = authed(server.addr, &token);
        assert_eq!(subscribe(&mut j, "d1")["type"], "subscribed");
        assert_eq!(subscribe(&mut j, "d2")["type"], "subscribed");
        assert_eq!(
            subscribe(&mut j, "d3")["limit"],
            "max_subscriptions_per_user"
        );
        let bad = jwt(
            json!({"sub":"jwt-user","exp":unix_now() + 600,"limits":{"connections":2}}),
            SECRET,
        );
        let mut c = Client::connect(server.addr);
        let v = auth(&mut c, &bad);
        assert_eq!(v["type"], "error", "{v}");
        assert!(
            v["message"].as_str().is_some_and(|m| m.contains("limits")),
            "{v}"
        );
    });
}
