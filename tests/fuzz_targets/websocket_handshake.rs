//! The WebSocket opening handshake: any request is upgraded, served the page, refused with a
//! well-formed HTTP response, or waited on; the same whichever way its bytes arrive.
//!
//! Input: byte 0 chooses the endpoint's settings (path, allowed origins, page, handshake limit)
//! and the receive schedule; the rest is what the client sends.

use powerhub::plugin::{Inbound, ProtocolError, ProtocolLimits};
use powerhub_websocket::{accept_key, WebSocket, WebSocketConfig, WebSocketFactory};

use super::support::{
    assert_ends_cleanly, assert_same, check_http_response, feed, Fed, Rng, BYTEWISE_MAX,
};

fn connection(mode: u8) -> WebSocket {
    let mut config = WebSocketConfig::default();
    if mode & 1 != 0 {
        config = config.with_path("/ws");
    }
    if mode & 2 != 0 {
        config = config.with_allowed_origins(["http://localhost:8080"]);
    }
    config = config.with_serve_page(mode & 4 != 0);
    if mode & 8 != 0 {
        config = config.with_max_handshake_bytes(256);
    }
    let factory = WebSocketFactory::new(config).expect("a valid config");
    factory.connection(&ProtocolLimits::default())
}

/// The check.
pub(crate) fn check(data: &[u8]) {
    let Some((&mode, request)) = data.split_first() else {
        return;
    };
    let mut conn = connection(mode);
    let whole = feed(&mut conn, request, || None, |_| {});
    if request.len() <= BYTEWISE_MAX {
        let bytewise = feed(&mut connection(mode), request, || Some(1), |_| {});
        assert_same(&whole, &bytewise, "handshake: whole and byte by byte");
    }
    let mut rng = Rng::new(u64::from(mode));
    let chunked = feed(&mut connection(mode), request, || Some(rng.chunk()), |_| {});
    assert_same(&whole, &chunked, "handshake: whole and in chunks");
    outcome(&whole, &conn, request);
    assert_ends_cleanly(&mut conn, &whole);
}

/// Whether the response is one that the request and the settings allow.
fn outcome(fed: &Fed, conn: &WebSocket, request: &[u8]) {
    use powerhub::plugin::StreamProtocol as _;
    let page_served = matches!(fed.events.first(), Some(Inbound::Close { reason, .. }) if reason == "page served");
    assert!(!conn.is_ready() || fed.urgent.starts_with(b"HTTP/1.1 101 "));
    if fed.urgent.starts_with(b"HTTP/1.1 101 ") {
        // Upgraded (what the frames that followed did is the codec's part).
        assert!(fed
            .urgent
            .starts_with(b"HTTP/1.1 101 Switching Protocols\r\n"));
        let end = find(&fed.urgent, b"\r\n\r\n").expect("the 101 head ends") + 4;
        assert_eq!(check_http_response(&fed.urgent[..end]), 101);
        let head = std::str::from_utf8(&fed.urgent[..end]).expect("UTF-8");
        let accept = head
            .split("\r\n")
            .find_map(|l| l.strip_prefix("Sec-WebSocket-Accept: "))
            .expect("an accept key");
        assert!(
            request_keys(request).any(|k| accept_key(k) == accept),
            "the accept key answers no key of the request"
        );
    } else if page_served {
        assert!(fed.result.is_ok());
        assert_eq!(fed.events.len(), 1);
        assert_eq!(check_http_response(&fed.urgent), 200);
    } else {
        match &fed.result {
            Err(ProtocolError::Handshake(_) | ProtocolError::TooLarge { .. }) => {
                let code = check_http_response(&fed.urgent);
                assert!((400..500).contains(&code), "refused with {code}");
                assert!(fed.events.is_empty());
            }
            Err(other) => panic!("a handshake failed with {other:?}"),
            Ok(()) => {
                assert!(
                    fed.urgent.is_empty() && fed.events.is_empty(),
                    "waiting, yet answered"
                );
                assert_eq!(fed.rest, request, "waiting, yet input was consumed");
            }
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The values of every `Sec-WebSocket-Key` line of the request head.
fn request_keys(request: &[u8]) -> impl Iterator<Item = &[u8]> {
    request.split(|&b| b == b'\n').filter_map(|line| {
        let colon = line.iter().position(|&b| b == b':')?;
        let (name, value) = line.split_at(colon);
        name.eq_ignore_ascii_case(b"sec-websocket-key")
            .then(|| value[1..].trim_ascii())
    })
}
