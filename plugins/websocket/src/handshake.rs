//! The server side of the opening handshake (RFC 6455 section 4.2) and the page response.

use std::borrow::Cow;
use std::fmt::Write as _;

use base64::Engine as _;
use bytes::{BufMut, BytesMut};
use sha1::{Digest, Sha1};

use crate::config::WebSocketConfig;

/// The GUID of RFC 6455 section 1.3, appended to the key before hashing.
const ACCEPT_GUID: &[u8] = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11";

/// Most header fields a request may carry.
const MAX_HEADERS: usize = 64;

/// The `Sec-WebSocket-Accept` value for a `Sec-WebSocket-Key` (RFC 6455 section 4.2.2).
///
/// ```
/// // The example of RFC 6455 section 1.3.
/// assert_eq!(
///     powerhub_websocket::accept_key(b"dGhlIHNhbXBsZSBub25jZQ=="),
///     "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
/// );
/// ```
pub fn accept_key(key: &[u8]) -> String {
    let mut sha = Sha1::new();
    sha.update(key);
    sha.update(ACCEPT_GUID);
    base64::engine::general_purpose::STANDARD.encode(sha.finalize())
}

/// What the handshake parser decided.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// The request is not complete yet.
    NeedMore,
    /// The upgrade is accepted: its 101 response was written; `consumed` request bytes; the
    /// credential the request carried (see [`credential`]).
    Upgraded {
        consumed: usize,
        credential: Option<String>,
    },
    /// The page (or its headers, for `HEAD`) was written; the connection closes after it.
    PageServed,
    /// The request is refused: the HTTP error response was written.
    Rejected(Rejection),
}

/// Why a request was refused.
#[derive(Debug)]
pub(crate) enum Rejection {
    /// The request line and headers exceed `max_handshake_bytes` (at least `size` bytes).
    TooLarge { size: usize },
    /// Any other refusal; the string names what was wrong.
    Invalid(String),
}

/// Finds the end of the request head (the empty line), scanning from `*scanned` and limited to
/// `limit + 1` bytes; remembers how far it looked so that a request fed byte by byte is scanned
/// once.
fn find_head_end(input: &[u8], scanned: &mut usize, limit: usize) -> Option<usize> {
    let end = input.len().min(limit.saturating_add(1));
    let start = scanned.saturating_sub(2);
    let window = input.get(start..end)?;
    for (i, _) in window.iter().enumerate().filter(|(_, &b)| b == b'\n') {
        let at = start + i;
        // An empty line is `\n\n` or `\n\r\n` (httparse accepts bare line feeds).
        if input.get(at + 1) == Some(&b'\n') {
            return Some(at + 2);
        }
        if input.get(at + 1) == Some(&b'\r') && input.get(at + 2) == Some(&b'\n') {
            return Some(at + 3);
        }
    }
    *scanned = end;
    None
}

/// Line-break bytes allowed before the request line (two empty lines, `\r\n\r\n`).
const MAX_LEADING_EMPTY_BYTES: usize = 4;

/// Parses the opening handshake at the front of `input` and writes the response to `urgent`.
pub(crate) fn process(
    input: &[u8],
    scanned: &mut usize,
    config: &WebSocketConfig,
    max_handshake: usize,
    urgent: &mut BytesMut,
) -> Outcome {
    // RFC 9112 lets a server ignore empty lines before the request line; more than a few are
    // no client's, and each would cost a parse of the whole head.
    let leading = input
        .iter()
        .take_while(|&&b| matches!(b, b'\r' | b'\n'))
        .count();
    // Only empty lines the parser would skip count (every `\r` followed by `\n`), judged on
    // bytes that have arrived, so that the answer is the same however the input is split:
    // anything else is the parser's to refuse.
    let proper = |run: &[u8]| {
        run.iter()
            .enumerate()
            .all(|(i, &b)| b == b'\n' || input.get(i + 1) == Some(&b'\n'))
    };
    let window = &input[..leading.min(MAX_LEADING_EMPTY_BYTES + 1)];
    if leading > MAX_LEADING_EMPTY_BYTES && proper(window) {
        let reason = "more than two empty lines before the request line";
        return reject(400, "Bad Request", reason, "", urgent);
    }
    // An HTTP request line starts with a method token: a TLS ClientHello (0x16) or any other
    // binary protocol is refused at once rather than at the first-message deadline.
    if let Some(&first) = input.get(leading).filter(|_| proper(&input[..leading])) {
        if !first.is_ascii_alphabetic() {
            let reason = "not an HTTP request (a TLS client on a plaintext port?)";
            return reject(400, "Bad Request", reason, "", urgent);
        }
    }
    loop {
        let Some(head_end) = find_head_end(input, scanned, max_handshake) else {
            if input.len() > max_handshake {
                return too_large(max_handshake, urgent);
            }
            return Outcome::NeedMore;
        };
        if head_end > max_handshake {
            return too_large(max_handshake, urgent);
        }
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&input[..head_end]) {
            Ok(httparse::Status::Complete(consumed)) => {
                return respond(&request, consumed, config, urgent);
            }
            // Only leading empty lines so far: look for an empty line after this one (the
            // search starts 2 bytes before `scanned`, so this moves it past `head_end - 1`).
            Ok(httparse::Status::Partial) => *scanned = head_end + 2,
            Err(httparse::Error::TooManyHeaders) => {
                let reason = format!("the request has more than {MAX_HEADERS} header fields");
                return reject(431, "Request Header Fields Too Large", &reason, "", urgent);
            }
            Err(e) => {
                let reason = format!("malformed HTTP request: {e}");
                return reject(400, "Bad Request", &reason, "", urgent);
            }
        }
    }
}

/// The head is longer than `limit`. The size reported is `limit + 1` whatever was read, so the
/// error does not depend on how the bytes were split.
fn too_large(limit: usize, urgent: &mut BytesMut) -> Outcome {
    let reason = format!("the request head exceeds max_handshake_bytes = {limit}");
    write_response(urgent, 431, "Request Header Fields Too Large", "", &reason);
    Outcome::Rejected(Rejection::TooLarge {
        size: limit.saturating_add(1),
    })
}

fn reject(
    status: u16,
    status_text: &str,
    reason: &str,
    extra_headers: &str,
    urgent: &mut BytesMut,
) -> Outcome {
    // The reason may quote the request (a path, a method): never more than 128 bytes of it.
    let reason = &powerhub_plugin::codes::echo(reason);
    write_response(urgent, status, status_text, extra_headers, reason);
    Outcome::Rejected(Rejection::Invalid(format!(
        "{status} {status_text}: {reason}"
    )))
}

/// The subprotocol the endpoint speaks (the push protocol), chosen when a client offers it in
/// `Sec-WebSocket-Protocol`; other offers are not chosen (RFC 6455 §4.2.2).
pub const SUBPROTOCOL: &str = "powerhub";

/// The request target in origin form (`/path?query`): an absolute-form target
/// (`http://host:port/path`, which RFC 9112 §3.2.2 says a server must accept) loses its scheme
/// and authority, and an empty path is `/`.
fn origin_form(target: &str) -> Cow<'_, str> {
    match absolute_form(target) {
        None => Cow::Borrowed(target),
        Some((_, "")) => Cow::Borrowed("/"),
        Some((_, rest)) if rest.starts_with('/') => Cow::Borrowed(rest),
        Some((_, query)) => Cow::Owned(format!("/{query}")),
    }
}

/// An absolute-form target (`http://host:port/path?query`) as its authority (`host:port`) and
/// what follows it (`/path?query`, `?query` or nothing); `None` for a target in origin form.
fn absolute_form(target: &str) -> Option<(&str, &str)> {
    let scheme = ["http://", "https://", "ws://", "wss://"]
        .into_iter()
        .find(|s| {
            target
                .get(..s.len())
                .is_some_and(|t| t.eq_ignore_ascii_case(s))
        })?;
    let rest = &target[scheme.len()..];
    Some(rest.split_at(rest.find(['/', '?']).unwrap_or(rest.len())))
}

/// Every value of header `name`, in order.
fn values<'a>(req: &'a httparse::Request<'_, '_>, name: &'a str) -> impl Iterator<Item = &'a [u8]> {
    req.headers
        .iter()
        .filter(move |h| h.name.eq_ignore_ascii_case(name))
        .map(|h| h.value)
}

/// The tokens of the comma-separated lists of header `name`, trimmed, in order.
fn tokens<'a>(req: &'a httparse::Request<'_, '_>, name: &'a str) -> impl Iterator<Item = &'a [u8]> {
    values(req, name)
        .flat_map(|v| v.split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
}

/// Whether the comma-separated token lists of header `name` contain `token` (any case).
fn has_token(req: &httparse::Request<'_, '_>, name: &str, token: &str) -> bool {
    tokens(req, name).any(|t| t.eq_ignore_ascii_case(token.as_bytes()))
}

fn respond(
    req: &httparse::Request<'_, '_>,
    consumed: usize,
    config: &WebSocketConfig,
    urgent: &mut BytesMut,
) -> Outcome {
    let method = req.method.unwrap_or_default();
    // RFC 9112 §3.2: an HTTP/1.1 request has exactly one `Host` (an upgrade needs it, below).
    let hosts = values(req, "host").count();
    if hosts > 1
        || (hosts == 0 && req.version == Some(1) && !has_token(req, "upgrade", "websocket"))
    {
        let reason = if hosts > 1 {
            "the Host header is given more than once"
        } else {
            "the Host header is missing"
        };
        return reject(400, "Bad Request", reason, "", urgent);
    }
    let target = origin_form(req.path.unwrap_or_default());
    let target = target.as_ref();
    let path = target.split_once('?').map_or(target, |(path, _query)| path);
    if path != config.path {
        let reason = format!(
            "no WebSocket endpoint at {path:?}; the endpoint is {:?}",
            config.path
        );
        return reject(404, "Not Found", &reason, "", urgent);
    }
    let upgrade = has_token(req, "upgrade", "websocket");
    // `HEAD` is for the page only; an upgrade must be a `GET`.
    let method_allowed = method == "GET" || (method == "HEAD" && !upgrade);
    if !method_allowed {
        let reason = format!("method {method} is not allowed; a WebSocket upgrade uses GET");
        return reject(
            405,
            "Method Not Allowed",
            &reason,
            "Allow: GET, HEAD\r\n",
            urgent,
        );
    }
    if !upgrade {
        if config.serve_page {
            write_page(urgent, method == "HEAD");
            return Outcome::PageServed;
        }
        let reason = "this endpoint accepts only WebSocket upgrades (Upgrade: websocket)";
        let headers = "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n";
        return reject(426, "Upgrade Required", reason, headers, urgent);
    }
    if req.version != Some(1) {
        return reject(
            400,
            "Bad Request",
            "a WebSocket upgrade requires HTTP/1.1",
            "",
            urgent,
        );
    }
    if !has_token(req, "connection", "upgrade") {
        let reason = "the Connection header must contain the upgrade token";
        return reject(400, "Bad Request", reason, "", urgent);
    }
    if values(req, "host").next().is_none() {
        return reject(400, "Bad Request", "the Host header is missing", "", urgent);
    }
    let mut versions = values(req, "sec-websocket-version");
    if versions.next().map(<[u8]>::trim_ascii) != Some(b"13") || versions.next().is_some() {
        let reason = "Sec-WebSocket-Version must be 13";
        return reject(
            426,
            "Upgrade Required",
            reason,
            "Sec-WebSocket-Version: 13\r\n",
            urgent,
        );
    }
    let mut keys = values(req, "sec-websocket-key");
    let key = match (keys.next().map(<[u8]>::trim_ascii), keys.next()) {
        (Some(key), None) if is_valid_key(key) => key,
        (None, _) => {
            return reject(
                400,
                "Bad Request",
                "Sec-WebSocket-Key is missing",
                "",
                urgent,
            )
        }
        (Some(_), Some(_)) => {
            let reason = "Sec-WebSocket-Key is given more than once";
            return reject(400, "Bad Request", reason, "", urgent);
        }
        (Some(_), None) => {
            let reason = "Sec-WebSocket-Key is not the base64 encoding of 16 bytes";
            return reject(400, "Bad Request", reason, "", urgent);
        }
    };
    if config.restricts_origins() {
        // RFC 6454 §7.3: at most one `Origin`; which of two to judge is no one's guess.
        if values(req, "origin").nth(1).is_some() {
            let reason = "the Origin header is given more than once";
            return reject(400, "Bad Request", reason, "", urgent);
        }
        let mut origins = values(req, "origin");
        let allowed = match (origins.next(), origins.next()) {
            (Some(origin), None) => {
                let origin = origin.trim_ascii();
                config
                    .allowed_origins
                    .iter()
                    .any(|a| a.as_bytes().eq_ignore_ascii_case(origin))
                    || (config.same_host_origin && is_same_host(req, origin))
            }
            (None, _) => config.allow_missing_origin,
            _ => false,
        };
        if !allowed {
            let origin = values(req, "origin").next().map(String::from_utf8_lossy);
            let reason = match origin {
                Some(origin) => format!(
                    "origin {:?} is not allowed on this listener (allowed_origins{})",
                    powerhub_plugin::codes::echo(&origin),
                    if config.same_host_origin {
                        ", or the listener's own host"
                    } else {
                        ""
                    }
                ),
                None => "the Origin header is missing and allowed_origins is set".to_owned(),
            };
            return reject(403, "Forbidden", &reason, "", urgent);
        }
    }
    urgent.put_slice(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n");
    urgent.put_slice(b"Connection: Upgrade\r\nSec-WebSocket-Accept: ");
    urgent.put_slice(accept_key(key).as_bytes());
    // Subprotocol names are compared as written (RFC 6455 §4.1: the client checks the answer
    // is one of its own values).
    if tokens(req, "sec-websocket-protocol").any(|t| t == SUBPROTOCOL.as_bytes()) {
        // A browser fails a connection whose offered protocols the server does not choose
        // from: a page that names protocols names this one.
        urgent.put_slice(b"\r\nSec-WebSocket-Protocol: ");
        urgent.put_slice(SUBPROTOCOL.as_bytes());
    }
    urgent.put_slice(b"\r\n\r\n");
    Outcome::Upgraded {
        consumed,
        credential: credential(req, target),
    }
}

/// The credential an upgrade request carries: the token of an `Authorization: Bearer` header
/// (RFC 6750 §2.1), else the percent-decoded value of the first `token` query parameter (§2.3;
/// a browser's WebSocket API cannot set headers). A header of another scheme (`Basic`, which a
/// proxy in front may add) is not this server's and is ignored, wherever it stands among the
/// `Authorization` fields; a value with no scheme, or one that is not UTF-8, is passed on as it
/// is, for the server to refuse by name.
fn credential(req: &httparse::Request<'_, '_>, target: &str) -> Option<String> {
    // The first Bearer value of any `Authorization` field (a proxy's `Basic` may come first),
    // else the first value with no scheme.
    let mut bare = None;
    for value in values(req, "authorization") {
        let value = String::from_utf8_lossy(value.trim_ascii());
        match value.split_once(' ') {
            Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => {
                return Some(token.trim().to_owned());
            }
            Some(_) => {}
            None => {
                bare.get_or_insert_with(|| value.into_owned());
            }
        }
    }
    if bare.is_some() {
        return bare;
    }
    let (_, query) = target.split_once('?')?;
    query
        .split('&')
        .find_map(|pair| pair.strip_prefix("token="))
        .map(percent_decode)
}

/// `%XX` escapes decoded and `+` read as a space (form encoding, as `URLSearchParams` writes
/// it); an invalid escape is kept as it is.
fn percent_decode(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'%' if i + 2 < b.len() => match (hex(b[i + 1]), hex(b[i + 2])) {
                (Some(h), Some(l)) => {
                    out.push((h * 16 + l) as u8);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `origin` (`scheme://host[:port]`) names the host the request was sent to (its `Host`
/// header, compared without regard to ASCII case, the scheme's default port written or not on
/// either side: RFC 6454 §4 gives `http://x` the port 80, and a browser omits it).
fn is_same_host(req: &httparse::Request<'_, '_>, origin: &[u8]) -> bool {
    let Some(at) = origin.windows(3).position(|w| w == b"://") else {
        return false;
    };
    let (scheme, authority) = (&origin[..at], &origin[at + 3..]);
    let default_port: &[u8] = match scheme.to_ascii_lowercase().as_slice() {
        b"http" | b"ws" => b":80",
        b"https" | b"wss" => b":443",
        _ => b"",
    };
    let bare = |a: &[u8]| -> Vec<u8> {
        let a = a.to_ascii_lowercase();
        match a.strip_suffix(default_port) {
            Some(host) if !default_port.is_empty() => host.to_vec(),
            _ => a,
        }
    };
    // A target in absolute form names the host itself, and `Host` is ignored (RFC 9112
    // §3.2.2).
    if let Some((target, _)) = absolute_form(req.path.unwrap_or_default()) {
        return bare(target.as_bytes()) == bare(authority);
    }
    let mut hosts = values(req, "host");
    match (hosts.next(), hosts.next()) {
        (Some(host), None) => bare(host.trim_ascii()) == bare(authority),
        _ => false,
    }
}

fn is_valid_key(key: &[u8]) -> bool {
    let mut decoded = [0u8; 18];
    key.len() == 24
        && base64::engine::general_purpose::STANDARD.decode_slice(key, &mut decoded) == Ok(16)
}

/// The reason phrase of a status the runtime refuses a connection with.
pub(crate) fn refusal_text(status: u16) -> &'static str {
    match status {
        400 => "Bad Request",
        408 => "Request Timeout",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

/// Writes an HTTP response whose plain-text body is `reason` and a newline; the connection
/// closes after it.
pub(crate) fn write_response(
    urgent: &mut BytesMut,
    status: u16,
    text: &str,
    headers: &str,
    reason: &str,
) {
    let mut head = String::with_capacity(160 + reason.len());
    let _ = write!(
        head,
        "HTTP/1.1 {status} {text}\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n{headers}\r\n{reason}\n",
        reason.len() + 1
    );
    urgent.put_slice(head.as_bytes());
}

fn write_page(urgent: &mut BytesMut, head_only: bool) {
    let page = crate::INDEX_HTML.as_bytes();
    let mut head = String::with_capacity(200);
    let _ = write!(
        head,
        "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\n\
         Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n",
        page.len()
    );
    urgent.put_slice(head.as_bytes());
    if !head_only {
        urgent.put_slice(page);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_key_matches_rfc_example() {
        assert_eq!(
            accept_key(b"dGhlIHNhbXBsZSBub25jZQ=="),
            "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="
        );
    }

    #[test]
    fn key_must_decode_to_16_bytes() {
        assert!(is_valid_key(b"dGhlIHNhbXBsZSBub25jZQ=="));
        assert!(!is_valid_key(b"dGhlIHNhbXBsZSBub25jZQ"));
        assert!(!is_valid_key(b"dGhlIHNhbXBsZSBub25jZWVl"));
        assert!(!is_valid_key(b"!!!!!!!!!!!!!!!!!!!!!!=="));
    }

    #[test]
    fn leading_empty_lines_are_skipped_without_looping() {
        let config = WebSocketConfig::default().with_serve_page(true);
        for prefix in ["\n\n", "\r\n\r\n", "\n\r\n\n", "\n\n\n\n"] {
            let request = format!("{prefix}GET / HTTP/1.1\r\nHost: a\r\n\r\n");
            let mut scanned = 0;
            let mut urgent = BytesMut::new();
            let outcome = process(request.as_bytes(), &mut scanned, &config, 1024, &mut urgent);
            assert!(
                matches!(outcome, Outcome::PageServed),
                "{prefix:?}: {outcome:?}"
            );
            // Fed in two parts: the empty lines, then the request.
            let mut scanned = 0;
            let mut urgent = BytesMut::new();
            let first = process(prefix.as_bytes(), &mut scanned, &config, 1024, &mut urgent);
            assert!(matches!(first, Outcome::NeedMore), "{prefix:?}: {first:?}");
            let outcome = process(request.as_bytes(), &mut scanned, &config, 1024, &mut urgent);
            assert!(
                matches!(outcome, Outcome::PageServed),
                "{prefix:?}: {outcome:?}"
            );
        }
    }

    /// A request with two `Origin` headers is refused as malformed, naming the header, not
    /// judged by the first of them.
    #[test]
    fn an_origin_header_given_twice_is_a_bad_request() {
        let config = WebSocketConfig::default().with_allowed_origins(["https://app.example"]);
        let request = "GET / HTTP/1.1\r\nHost: a\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                       Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
                       Origin: https://app.example\r\nOrigin: https://evil.example\r\n\r\n";
        let mut scanned = 0;
        let mut urgent = BytesMut::new();
        process(request.as_bytes(), &mut scanned, &config, 4096, &mut urgent);
        let answer = String::from_utf8_lossy(&urgent);
        assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
        assert!(
            answer.contains("Origin header is given more than once"),
            "{answer}"
        );
    }

    #[test]
    fn head_end_is_found_across_calls() {
        let mut scanned = 0;
        let req = b"GET / HTTP/1.1\r\nHost: a\r\n\r\nrest";
        assert_eq!(find_head_end(&req[..20], &mut scanned, 100), None);
        assert_eq!(find_head_end(&req[..26], &mut scanned, 100), None);
        assert_eq!(find_head_end(&req[..], &mut scanned, 100), Some(27));
    }
}
