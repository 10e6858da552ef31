//! A small scanner over the top level of a JSON object: finds the byte span of one member's value
//! without decoding it, so that a published message is forwarded byte for byte.
//!
//! It never panics and stops at the first thing that is not JSON it understands (returning
//! `None`); full validation is simd-json's job.

use std::ops::Range;

/// Nesting depth past which the scanner gives up (simd-json enforces its own limit).
const MAX_DEPTH: usize = 1024;

/// The span of the value of the top-level member `key` of the JSON object in `json`, if the
/// object is well formed up to that member. The last occurrence wins, as in simd-json and serde.
pub(crate) fn member_span(json: &[u8], key: &str) -> Option<Range<usize>> {
    let mut found = None;
    let mut i = skip_ws(json, 0);
    if json.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(json, i + 1);
    if json.get(i) == Some(&b'}') {
        return None;
    }
    loop {
        let key_start = i;
        let Some(key_end) = skip_string(json, i) else {
            return found;
        };
        let matches = key_matches(&json[key_start..key_end], key);
        i = skip_ws(json, key_end);
        if json.get(i) != Some(&b':') {
            return found;
        }
        i = skip_ws(json, i + 1);
        let value_start = i;
        let Some(value_end) = skip_value(json, i) else {
            return found;
        };
        if matches {
            found = Some(value_start..value_end);
        }
        i = skip_ws(json, value_end);
        match json.get(i) {
            Some(b',') => i = skip_ws(json, i + 1),
            _ => return found,
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
        match json.get(j)? {
            b'"' => return Some(j + 1),
            b'\\' => j += 2,
            _ => j += 1,
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
    use super::member_span;

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
    }

    #[test]
    fn escaped_keys_match_their_decoded_form() {
        assert_eq!(span(r#"{"i\u0064":"r1"}"#, "id"), Some(r#""r1""#));
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
        ] {
            let _ = span(json, "a");
        }
        assert_eq!(span(r#"{"id":"r9", bad"#, "id"), Some(r#""r9""#));
    }
}
