//! A small scanner over the top level of a JSON object: finds the byte spans of some members'
//! values without decoding them, so that a published message is forwarded byte for byte and an
//! outbox can classify a 2 MiB screenshot by reading a few short fields.
//!
//! It never panics. Strings are skipped with `memchr` (a base64 image is one long string).
//! Full validation is the command parser's job: the scanner only reports whether the object's top level
//! was well formed.

use std::ops::Range;

/// Nesting depth past which the scanner gives up.
const MAX_DEPTH: usize = 1024;

/// The spans of the values of the top-level members named in `keys` (the last occurrence of a
/// key wins), and whether the whole top level was well formed with each of `keys` at most once
/// (`false`: the spans found before the first error are still returned).
pub(crate) fn members<const N: usize>(
    json: &[u8],
    keys: [&str; N],
) -> ([Option<Range<usize>>; N], bool) {
    let mut found: [Option<Range<usize>>; N] = std::array::from_fn(|_| None);
    let mut duplicate = false;
    let ok = scan(json, |key, span| {
        for (k, slot) in keys.iter().zip(found.iter_mut()) {
            if key_matches(key, k) {
                duplicate |= slot.is_some();
                *slot = Some(span.clone());
            }
        }
    });
    (found, ok && !duplicate)
}

/// The span of the value of the top-level member `key`, if the object is well formed up to it.
#[cfg(test)]
pub(crate) fn member_span(json: &[u8], key: &str) -> Option<Range<usize>> {
    let ([span], _) = members(json, [key]);
    span
}

/// Calls `each(quoted_key, value_span)` for every top-level member; returns whether the object
/// was well formed (and nothing but whitespace follows it).
fn scan(json: &[u8], mut each: impl FnMut(&[u8], Range<usize>)) -> bool {
    let mut i = skip_ws(json, 0);
    if json.get(i) != Some(&b'{') {
        return false;
    }
    i = skip_ws(json, i + 1);
    if json.get(i) == Some(&b'}') {
        return skip_ws(json, i + 1) == json.len();
    }
    loop {
        let key_start = i;
        let Some(key_end) = skip_string(json, i) else {
            return false;
        };
        i = skip_ws(json, key_end);
        if json.get(i) != Some(&b':') {
            return false;
        }
        i = skip_ws(json, i + 1);
        let value_start = i;
        let Some(value_end) = skip_value(json, i) else {
            return false;
        };
        each(&json[key_start..key_end], value_start..value_end);
        i = skip_ws(json, value_end);
        match json.get(i) {
            Some(b',') => i = skip_ws(json, i + 1),
            Some(b'}') => return skip_ws(json, i + 1) == json.len(),
            _ => return false,
        }
    }
}

fn key_matches(quoted: &[u8], key: &str) -> bool {
    let inner = &quoted[1..quoted.len() - 1];
    if !inner.contains(&b'\\') {
        return inner == key.as_bytes();
    }
    serde_json::from_slice::<String>(quoted).is_ok_and(|k| k == key)
}

/// The contents of a JSON string literal without escapes (borrowed), `None` if it has escapes
/// or is not a string.
pub(crate) fn plain_str(value: &[u8]) -> Option<&str> {
    let inner = value.strip_prefix(b"\"")?.strip_suffix(b"\"")?;
    if inner.contains(&b'\\') {
        return None;
    }
    std::str::from_utf8(inner).ok()
}

fn skip_ws(json: &[u8], mut i: usize) -> usize {
    while let Some(b' ' | b'\t' | b'\n' | b'\r') = json.get(i) {
        i += 1;
    }
    i
}

/// `json[i]` must open a string; returns the index after its closing quote.
fn skip_string(json: &[u8], i: usize) -> Option<usize> {
    if json.get(i) != Some(&b'"') {
        return None;
    }
    let mut j = i + 1;
    loop {
        j += memchr::memchr2(b'"', b'\\', json.get(j..)?)?;
        match json[j] {
            b'"' => return Some(j + 1),
            _ => j += 2,
        }
    }
}

/// Returns the index after the value starting at `json[i]`.
fn skip_value(json: &[u8], i: usize) -> Option<usize> {
    match json.get(i)? {
        b'"' => skip_string(json, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match json.get(j)? {
                    b'"' => {
                        j = skip_string(json, j)?;
                        continue;
                    }
                    b'{' | b'[' => {
                        depth += 1;
                        if depth > MAX_DEPTH {
                            return None;
                        }
                    }
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
        }
        _ => {
            let mut j = i;
            while let Some(&b) = json.get(j) {
                if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            (j > i).then_some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{member_span, members, plain_str};

    fn span<'a>(json: &'a str, key: &str) -> Option<&'a str> {
        member_span(json.as_bytes(), key).map(|r| &json[r])
    }

    #[test]
    fn finds_nested_object_verbatim() {
        let json = r#"{"type":"publish","message":{"a":[1,{"b":"}"}],"s":"\"x"} ,"id":7}"#;
        assert_eq!(
            span(json, "message"),
            Some(r#"{"a":[1,{"b":"}"}],"s":"\"x"}"#)
        );
        assert_eq!(span(json, "id"), Some("7"));
        assert_eq!(span(json, "nope"), None);
        let ([a, b], ok) = members(json.as_bytes(), ["type", "id"]);
        assert!(ok);
        assert_eq!(
            (&json[a.unwrap()], &json[b.unwrap()]),
            (r#""publish""#, "7")
        );
    }

    #[test]
    fn escaped_keys_match_their_decoded_form() {
        assert_eq!(span(r#"{"i\u0064":"r1"}"#, "id"), Some(r#""r1""#));
        assert_eq!(plain_str(br#""a\"b""#), None);
        assert_eq!(plain_str(br#""ab""#), Some("ab"));
    }

    #[test]
    fn broken_input_never_panics() {
        for json in [
            "",
            "{",
            "{\"",
            "{\"a\"",
            "{\"a\":",
            "{\"a\":[",
            "{\"a\":\"\\",
            "[1]",
            "{\"a\":1,",
            "{\"a\":\"\\\"",
        ] {
            let _ = span(json, "a");
            assert!(!members(json.as_bytes(), ["a"]).1, "{json}");
        }
        assert_eq!(span(r#"{"id":"r9", bad"#, "id"), Some(r#""r9""#));
        assert!(members(b" {} ", ["a"]).1);
        assert!(!members(b"{} x", ["a"]).1);
    }
}
