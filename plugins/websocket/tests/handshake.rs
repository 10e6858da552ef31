//! The opening handshake (RFC 6455 section 4.2) and the page, one test per rule.

mod util;

use powerhub_plugin::{Inbound, ProtocolError, ProtocolFactory, ProtocolLimits};
use powerhub_websocket::{WebSocketConfig, INDEX_HTML};
use util::*;

fn reject(config: WebSocketConfig, request: &str) -> Step {
    let mut conn = connection(config);
    let step = feed(conn.as_mut(), request.as_bytes());
    assert!(
        matches!(
            step.result,
            Err(ProtocolError::Handshake(_) | ProtocolError::TooLarge { .. })
        ),
        "{step:?}"
    );
    assert!(!conn.is_ready());
    step
}

fn body_of(urgent: &[u8]) -> String {
    let text = String::from_utf8_lossy(urgent);
    text.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}

#[test]
fn handshake_valid_upgrade_returns_101_with_accept_key() {
    let mut conn = connection(WebSocketConfig::default());
    assert!(!conn.is_ready());
    let step = feed(conn.as_mut(), request("/", "").as_bytes());
    assert_eq!(step.result, Ok(()));
    assert_eq!(step.left, 0);
    let response = String::from_utf8(step.urgent).unwrap();
    assert_eq!(
        response,
        format!(
            "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Accept: {ACCEPT}\r\n\r\n"
        )
    );
    assert!(conn.is_ready());
}

#[test]
fn handshake_accepts_token_lists_any_case_and_a_query() {
    let request = format!(
        "GET /?topic=a HTTP/1.1\r\nhost: x\r\nupgrade: WebSocket\r\nconnection: keep-alive, Upgrade\r\n\
         sec-websocket-key: {KEY}\r\nsec-websocket-version: 13\r\n\r\n"
    );
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(conn.as_mut(), request.as_bytes());
    assert_eq!(step.result, Ok(()));
    assert_eq!(status_of(&step.urgent), 101);
}

#[test]
fn handshake_split_byte_by_byte_gives_the_same_response() {
    let request = request("/", "");
    let mut conn = connection(WebSocketConfig::default());
    let mut input = powerhub_plugin::BytesMut::new();
    let mut out = powerhub_plugin::ProtocolOutput::default();
    for &b in request.as_bytes() {
        input.extend_from_slice(&[b]);
        conn.decode(&mut input, &mut out).unwrap();
    }
    assert_eq!(input.len(), 0);
    assert!(out
        .urgent
        .ends_with(format!("Sec-WebSocket-Accept: {ACCEPT}\r\n\r\n").as_bytes()));
    assert!(conn.is_ready());
}

#[test]
fn handshake_frames_pipelined_after_the_request_are_decoded() {
    let mut bytes = request("/", "").into_bytes();
    bytes.extend(data(0x1, b"{\"type\":\"subscribe\"}"));
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(conn.as_mut(), &bytes);
    assert_eq!(step.result, Ok(()));
    assert_eq!(
        step.events,
        vec![Inbound::Text("{\"type\":\"subscribe\"}".into())]
    );
}

#[test]
fn handshake_wrong_path_is_404() {
    let step = reject(
        WebSocketConfig::default().with_path("/ws"),
        &request("/other", ""),
    );
    assert_eq!(status_of(&step.urgent), 404);
    assert!(body_of(&step.urgent).contains("/other"));
}

#[test]
fn handshake_method_other_than_get_is_405() {
    let request = request("/", "").replacen("GET", "POST", 1);
    let step = reject(WebSocketConfig::default(), &request);
    assert_eq!(status_of(&step.urgent), 405);
    assert!(String::from_utf8_lossy(&step.urgent).contains("Allow: GET"));
}

#[test]
fn handshake_http_1_0_upgrade_is_400() {
    let request = request("/", "").replacen("HTTP/1.1", "HTTP/1.0", 1);
    let step = reject(WebSocketConfig::default(), &request);
    assert_eq!(status_of(&step.urgent), 400);
    assert!(body_of(&step.urgent).contains("HTTP/1.1"));
}

#[test]
fn handshake_connection_without_upgrade_token_is_400() {
    let request = request("/", "").replace("Connection: Upgrade", "Connection: keep-alive");
    let step = reject(WebSocketConfig::default(), &request);
    assert_eq!(status_of(&step.urgent), 400);
    assert!(body_of(&step.urgent).contains("Connection"));
}

#[test]
fn handshake_missing_host_is_400() {
    let request = request("/", "").replace("Host: localhost:8080\r\n", "");
    let step = reject(WebSocketConfig::default(), &request);
    assert_eq!(status_of(&step.urgent), 400);
    assert!(body_of(&step.urgent).contains("Host"));
}

#[test]
fn handshake_version_other_than_13_is_426_naming_13() {
    for version in ["Sec-WebSocket-Version: 8\r\n", ""] {
        let request = request("/", "").replace("Sec-WebSocket-Version: 13\r\n", version);
        let step = reject(WebSocketConfig::default(), &request);
        assert_eq!(status_of(&step.urgent), 426);
        assert!(String::from_utf8_lossy(&step.urgent).contains("Sec-WebSocket-Version: 13\r\n"));
    }
}

#[test]
fn handshake_invalid_key_is_400() {
    let bad_keys = [
        String::new(),
        "Sec-WebSocket-Key: c2hvcnQ=\r\n".to_owned(),
        "Sec-WebSocket-Key: !!!!!!!!!!!!!!!!!!!!!!==\r\n".to_owned(),
        format!("Sec-WebSocket-Key: {KEY}\r\nSec-WebSocket-Key: {KEY}\r\n"),
    ];
    for key in bad_keys {
        let request = request("/", "").replace(&format!("Sec-WebSocket-Key: {KEY}\r\n"), &key);
        let step = reject(WebSocketConfig::default(), &request);
        assert_eq!(status_of(&step.urgent), 400, "{key:?}");
        assert!(
            body_of(&step.urgent).contains("Sec-WebSocket-Key"),
            "{key:?}"
        );
    }
}

#[test]
fn handshake_origin_not_allowed_is_403() {
    let config = WebSocketConfig::default().with_allowed_origins(["http://good.test"]);
    let step = reject(
        config.clone(),
        &request("/", "Origin: http://evil.test\r\n"),
    );
    assert_eq!(status_of(&step.urgent), 403);
    assert!(body_of(&step.urgent).contains("http://evil.test"));

    let step = reject(config, &request("/", ""));
    assert_eq!(status_of(&step.urgent), 403);
    assert!(body_of(&step.urgent).contains("Origin header is missing"));
}

#[test]
fn handshake_allowed_origin_matches_without_regard_to_case() {
    let config = WebSocketConfig::default().with_allowed_origins(["http://good.test:8080"]);
    let mut conn = connection(config);
    let step = feed(
        conn.as_mut(),
        request("/", "Origin: HTTP://Good.Test:8080\r\n").as_bytes(),
    );
    assert_eq!(step.result, Ok(()));
    assert_eq!(status_of(&step.urgent), 101);
}

#[test]
fn handshake_any_origin_when_allowed_origins_is_empty() {
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(
        conn.as_mut(),
        request("/", "Origin: http://anything.test\r\n").as_bytes(),
    );
    assert_eq!(status_of(&step.urgent), 101);
}

#[test]
fn handshake_over_max_handshake_bytes_is_431_too_large() {
    let config = WebSocketConfig::default().with_max_handshake_bytes(256);
    let padding = format!("X-Padding: {}\r\n", "a".repeat(300));
    let step = reject(config.clone(), &request("/", &padding));
    assert_eq!(status_of(&step.urgent), 431);
    assert_eq!(
        step.result,
        Err(ProtocolError::TooLarge {
            what: "handshake",
            limit_name: "max_handshake_bytes",
            size: 257,
            limit: 256
        })
    );
    // Without an end of headers in sight, the limit still applies.
    let step = reject(config, &"G".repeat(1000));
    assert_eq!(status_of(&step.urgent), 431);
}

#[test]
fn handshake_limit_is_the_tighter_of_config_and_runtime() {
    let factory = factory(WebSocketConfig::default());
    let limits = ProtocolLimits::default().with_max_handshake_bytes(100);
    let mut conn = factory.new_connection(&limits);
    let step = feed(conn.as_mut(), request("/", "").as_bytes());
    assert!(
        matches!(step.result, Err(ProtocolError::TooLarge { limit: 100, .. })),
        "{step:?}"
    );
}

#[test]
fn handshake_malformed_request_is_400() {
    let step = reject(
        WebSocketConfig::default(),
        "GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    );
    assert_eq!(status_of(&step.urgent), 400);
    assert!(body_of(&step.urgent).contains("malformed"));
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(
        conn.as_mut(),
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\r\n\r\n",
    );
    assert_eq!(status_of(&step.urgent), 400);
}

#[test]
fn handshake_too_many_header_fields_is_431() {
    let many: String = (0..100).map(|i| format!("X-{i}: y\r\n")).collect();
    let step = reject(WebSocketConfig::default(), &request("/", &many));
    assert_eq!(status_of(&step.urgent), 431);
}

#[test]
fn handshake_rejection_is_sticky() {
    let mut conn = connection(WebSocketConfig::default().with_path("/ws"));
    let first = feed(conn.as_mut(), request("/", "").as_bytes());
    let again = feed(conn.as_mut(), &data(0x1, b"x"));
    assert_eq!(first.result, again.result);
    assert!(again.urgent.is_empty());
    assert_eq!(again.left, 0);
}

#[test]
fn page_get_without_upgrade_serves_html_and_closes() {
    let mut conn = connection(WebSocketConfig::default().with_serve_page(true));
    let step = feed(conn.as_mut(), b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n");
    assert_eq!(step.result, Ok(()));
    let response = String::from_utf8(step.urgent).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"));
    assert!(response.contains("Content-Type: text/html; charset=utf-8\r\n"));
    assert!(response.contains(&format!("Content-Length: {}\r\n", INDEX_HTML.len())));
    assert!(response.contains("Connection: close\r\n"));
    assert!(response.ends_with(INDEX_HTML));
    assert!(matches!(
        step.events.as_slice(),
        [Inbound::Close { code: 1000, .. }]
    ));
    assert!(!conn.is_ready());
    // Nothing more is read on that connection.
    let step = feed(conn.as_mut(), b"GET / HTTP/1.1\r\n\r\n");
    assert_eq!(
        (step.result, step.events.len(), step.urgent.len(), step.left),
        (Ok(()), 0, 0, 0)
    );
}

#[test]
fn page_head_serves_headers_only() {
    let mut conn = connection(WebSocketConfig::default().with_serve_page(true));
    let step = feed(conn.as_mut(), b"HEAD / HTTP/1.1\r\nHost: localhost\r\n\r\n");
    let response = String::from_utf8(step.urgent).unwrap();
    assert!(response.starts_with("HTTP/1.1 200 OK\r\n"));
    assert!(response.ends_with("\r\n\r\n"));
}

#[test]
fn page_disabled_get_without_upgrade_is_426() {
    let step = reject(
        WebSocketConfig::default(),
        "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    );
    assert_eq!(status_of(&step.urgent), 426);
    assert!(String::from_utf8_lossy(&step.urgent).contains("Upgrade: websocket\r\n"));
}

#[test]
fn page_is_self_contained() {
    assert!(INDEX_HTML.contains("<script>"));
    assert!(INDEX_HTML.contains("<style>"));
    for external in ["src=\"http", "href=\"http", "src='http", "@import", "<link"] {
        assert!(
            !INDEX_HTML.contains(external),
            "the page loads an external resource: {external}"
        );
    }
}

#[test]
fn a_refusal_before_the_upgrade_is_an_http_response_and_nothing_follows_it() {
    use powerhub_plugin::BytesMut;
    let mut conn = connection(WebSocketConfig::default());
    let mut out = BytesMut::new();
    assert!(conn.encode_refusal(503, "over max_connections", &mut out));
    let text = String::from_utf8(out.to_vec()).unwrap();
    assert!(
        text.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{text}"
    );
    assert_eq!(body_of(&out), "over max_connections\n");
    // Nothing is framed after it, and a request arriving now is not answered.
    let mut after = BytesMut::new();
    conn.encode_text(b"{}", &mut after);
    conn.encode_close(1001, "bye", &mut after);
    assert!(after.is_empty(), "{after:?}");
    let step = feed(conn.as_mut(), request("/", "").as_bytes());
    assert!(step.urgent.is_empty() && !conn.is_ready(), "{step:?}");
}

#[test]
fn an_upgraded_connection_has_no_refusal() {
    use powerhub_plugin::BytesMut;
    let mut conn = connection(WebSocketConfig::default());
    feed(conn.as_mut(), request("/", "").as_bytes());
    let mut out = BytesMut::new();
    assert!(!conn.encode_refusal(408, "late", &mut out));
    assert!(out.is_empty());
}

/// Empty lines before the request line are allowed (two of them), not a stream of them: each
/// would cost a parse of the whole head.
#[test]
fn handshake_refuses_more_than_two_empty_lines_before_the_request_line() {
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(
        conn.as_mut(),
        format!("\r\n\r\n{}", request("/", "")).as_bytes(),
    );
    assert_eq!(step.result, Ok(()));
    assert!(conn.is_ready());
    let step = reject(WebSocketConfig::default(), &"\n".repeat(8191));
    assert!(String::from_utf8_lossy(&step.urgent).starts_with("HTTP/1.1 400"));
}

/// A refusal quotes at most 128 bytes of the request, and a request that is not HTTP (a TLS
/// ClientHello) is refused at once.
#[test]
fn handshake_refusals_quote_little_and_refuse_non_http_at_once() {
    let path = format!("/{}", "A".repeat(7000));
    let step = reject(WebSocketConfig::default(), &request(&path, ""));
    let text = String::from_utf8_lossy(&step.urgent).into_owned();
    assert!(text.starts_with("HTTP/1.1 404"), "{text:.80}");
    assert!(text.len() < 600, "{} bytes", text.len());
    let step = reject(
        WebSocketConfig::default(),
        "\u{16}\u{3}\u{1}\u{2}\u{0}\u{1}",
    );
    assert!(String::from_utf8_lossy(&step.urgent).starts_with("HTTP/1.1 400"));
}

#[test]
fn a_bearer_token_in_the_upgrade_is_the_first_event() {
    let mut bytes = request("/", "Authorization: Bearer abc.def.ghi\r\n").into_bytes();
    bytes.extend(data(0x1, b"{\"type\":\"ping\"}"));
    let step = feed(connection(WebSocketConfig::default()).as_mut(), &bytes);
    assert_eq!(step.result, Ok(()));
    assert_eq!(status_of(&step.urgent), 101);
    assert_eq!(
        step.events,
        vec![
            Inbound::Credential("abc.def.ghi".into()),
            Inbound::Text(powerhub_plugin::Bytes::from_static(b"{\"type\":\"ping\"}")),
        ]
    );
}

#[test]
fn a_token_query_parameter_is_percent_decoded_and_the_path_still_matches() {
    for (target, token) in [
        ("/?token=t%2B1%3D+x", "t+1= x"),
        ("/?a=1&token=abc&token=ignored", "abc"),
        ("/?token=%zz", "%zz"),
    ] {
        let step = feed(
            connection(WebSocketConfig::default()).as_mut(),
            request(target, "").as_bytes(),
        );
        assert_eq!(status_of(&step.urgent), 101, "{target}");
        assert_eq!(
            step.events,
            vec![Inbound::Credential(token.into())],
            "{target}"
        );
    }
    // A Bearer header wins over the query.
    let step = feed(
        connection(WebSocketConfig::default()).as_mut(),
        request("/?token=q", "Authorization: Bearer h\r\n").as_bytes(),
    );
    assert_eq!(step.events, vec![Inbound::Credential("h".into())]);
    // A header of another scheme (a proxy's `Basic`) is not a token: ignored, so the query's
    // token, or none (the client may still send `auth`).
    let step = feed(
        connection(WebSocketConfig::default()).as_mut(),
        request("/?token=q", "Authorization: Basic dXNlcjpwdw==\r\n").as_bytes(),
    );
    assert_eq!(step.events, vec![Inbound::Credential("q".into())]);
    let step = feed(
        connection(WebSocketConfig::default()).as_mut(),
        request("/", "Authorization: Basic dXNlcjpwdw==\r\n").as_bytes(),
    );
    assert!(step.events.is_empty(), "{:?}", step.events);
    // A proxy's Basic field before the client's Bearer one does not hide the token.
    let step = feed(
        connection(WebSocketConfig::default()).as_mut(),
        request(
            "/",
            "Authorization: Basic dXNlcjpwdw==\r\nAuthorization: Bearer b\r\n",
        )
        .as_bytes(),
    );
    assert_eq!(step.events, vec![Inbound::Credential("b".into())]);
    // A value with no scheme is passed on whole, for the server to refuse by name.
    let step = feed(
        connection(WebSocketConfig::default()).as_mut(),
        request("/", "Authorization: raw-token\r\n").as_bytes(),
    );
    assert_eq!(step.events, vec![Inbound::Credential("raw-token".into())]);
    // No credential, no event.
    let step = feed(
        connection(WebSocketConfig::default()).as_mut(),
        request("/?v=2", "").as_bytes(),
    );
    assert!(step.events.is_empty(), "{:?}", step.events);
}

#[test]
fn same_host_origins_and_null_are_decided_explicitly() {
    let same_host = WebSocketConfig::default()
        .with_same_host_origin(true)
        .with_allow_missing_origin(true);
    // `request` sends Host: localhost:8080.
    for (origin, status) in [
        ("http://localhost:8080", 101),
        ("https://LOCALHOST:8080", 101),
        ("http://localhost:8081", 403),
        ("http://evil.example", 403),
        ("null", 403),
    ] {
        let step = feed(
            connection(same_host.clone()).as_mut(),
            request("/", &format!("Origin: {origin}\r\n")).as_bytes(),
        );
        assert_eq!(status_of(&step.urgent), status, "Origin: {origin}");
    }
    let step = feed(
        connection(same_host.clone()).as_mut(),
        request("/", "").as_bytes(),
    );
    assert_eq!(status_of(&step.urgent), 101, "no Origin: a program");
    // The scheme's default port, written on one side and not on the other, is the same
    // origin (RFC 6454 §4); another port is not.
    for (host, origin, status) in [
        ("app.example", "http://app.example:80", 101),
        ("app.example:80", "http://app.example", 101),
        ("app.example:443", "https://app.example", 101),
        ("app.example", "wss://app.example:443", 101),
        ("app.example:80", "https://app.example", 403),
        ("app.example:8080", "http://app.example", 403),
        ("app.example", "http://app.example:8080", 403),
    ] {
        let head = format!(
            "GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
             Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
             Origin: {origin}\r\n\r\n"
        );
        let step = feed(connection(same_host.clone()).as_mut(), head.as_bytes());
        assert_eq!(
            status_of(&step.urgent),
            status,
            "Host: {host}, Origin: {origin}"
        );
    }
    let listed = WebSocketConfig::default().with_allowed_origins(["null"]);
    let step = feed(
        connection(listed).as_mut(),
        request("/", "Origin: null\r\n").as_bytes(),
    );
    assert_eq!(status_of(&step.urgent), 101, "null, listed");
}

/// RFC 9112 §3.2: an HTTP/1.1 request carries exactly one `Host`; two, or none on a request for
/// the page, get 400.
#[test]
fn a_request_with_two_hosts_or_a_page_request_without_one_gets_400() {
    let step = reject(
        WebSocketConfig::default(),
        &request("/", "Host: other:8080\r\n"),
    );
    assert_eq!(status_of(&step.urgent), 400);
    assert!(body_of(&step.urgent).contains("more than once"));
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(conn.as_mut(), b"GET / HTTP/1.1\r\n\r\n");
    assert_eq!(status_of(&step.urgent), 400);
    assert!(body_of(&step.urgent).contains("Host header is missing"));
    // HTTP/1.0 needs none (the page is off by default: 426, not 400).
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(conn.as_mut(), b"GET / HTTP/1.0\r\n\r\n");
    assert_eq!(status_of(&step.urgent), 426);
}

/// RFC 9112 §3.2.2: a server accepts a request target in absolute form.
#[test]
fn an_absolute_form_target_is_the_path_it_names() {
    for (target, ok) in [
        ("http://localhost:8080/", true),
        ("HTTP://localhost:8080/?token=t", true),
        ("ws://localhost:8080", true),
        ("http://localhost:8080?token=t", true),
        ("http://localhost:8080/other", false),
    ] {
        let mut conn = connection(WebSocketConfig::default());
        let step = feed(conn.as_mut(), request(target, "").as_bytes());
        let status = status_of(&step.urgent);
        assert_eq!(status, if ok { 101 } else { 404 }, "{target}");
    }
    let mut conn = connection(WebSocketConfig::default());
    let step = feed(
        conn.as_mut(),
        request("http://localhost:8080/?token=abc", "").as_bytes(),
    );
    assert_eq!(step.events, vec![Inbound::Credential("abc".into())]);
    // The target's authority is the host a same-host origin is compared with (`Host` is
    // ignored then).
    let same_host = WebSocketConfig::default().with_same_host_origin(true);
    for (target, ok) in [("http://app.example:7402/", true), ("/", false)] {
        let extra = "Origin: http://app.example:7402\r\n";
        let step = feed(
            connection(same_host.clone()).as_mut(),
            request(target, extra).as_bytes(),
        );
        let want = if ok { 101 } else { 403 };
        assert_eq!(status_of(&step.urgent), want, "{target}");
    }
}

/// A client that offers subprotocols gets `powerhub` chosen when it is among them (a browser
/// fails a connection whose offered protocols the server does not choose from), and none
/// otherwise (RFC 6455 §4.2.2).
#[test]
fn the_powerhub_subprotocol_is_chosen_when_offered() {
    let offered = |protocols: &str| {
        let mut conn = connection(WebSocketConfig::default());
        let extra = format!("Sec-WebSocket-Protocol: {protocols}\r\n");
        let step = feed(conn.as_mut(), request("/", &extra).as_bytes());
        assert_eq!(status_of(&step.urgent), 101);
        String::from_utf8(step.urgent).unwrap()
    };
    let chosen = format!(
        "Sec-WebSocket-Protocol: {}\r\n",
        powerhub_websocket::SUBPROTOCOL
    );
    assert!(offered("chat, powerhub").contains(&chosen));
    assert!(offered("powerhub").contains(&chosen));
    assert!(!offered("chat, v2.json").contains("Sec-WebSocket-Protocol"));
    // Another spelling is another protocol: the answer must be one of the client's values.
    assert!(!offered("PowerHub").contains("Sec-WebSocket-Protocol"));
}
