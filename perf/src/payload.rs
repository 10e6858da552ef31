//! The benchmark message: a JSON object carrying a sequence number and a monotonic send time in
//! fixed-width decimal fields, padded to an exact size.
//!
//! ```text
//! {"seq":00000000000000000042,"t":00000001234567890123,"p":"xxxx"}
//! ```
//!
//! Fixed widths let the publisher stamp a pre-encoded template in place (no re-encoding per
//! message) and let readers parse the two numbers without a JSON parser. Every system receives
//! byte-identical messages.

use memchr::memmem;

const SEQ_KEY: &[u8] = b"\"seq\":";
const T_KEY: &[u8] = b",\"t\":";
const DIGITS: usize = 20;

/// A message template that is stamped in place.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    bytes: Vec<u8>,
    seq_at: usize,
    t_at: usize,
}

impl Template {
    /// A template of exactly `size` bytes (or the smallest possible, if `size` is smaller),
    /// with `extra` (a run of `"key":value,` pairs) placed before the padding field.
    pub(crate) fn new(size: usize, extra: &str) -> Template {
        let mut bytes = Vec::with_capacity(size);
        bytes.extend_from_slice(b"{");
        bytes.extend_from_slice(SEQ_KEY);
        let seq_at = bytes.len();
        bytes.extend_from_slice(&[b'0'; DIGITS]);
        bytes.extend_from_slice(T_KEY);
        let t_at = bytes.len();
        bytes.extend_from_slice(&[b'0'; DIGITS]);
        bytes.extend_from_slice(b",");
        bytes.extend_from_slice(extra.as_bytes());
        bytes.extend_from_slice(b"\"p\":\"");
        let fixed = bytes.len() + 2;
        bytes.resize(bytes.len() + size.saturating_sub(fixed), b'x');
        bytes.extend_from_slice(b"\"}");
        Template {
            bytes,
            seq_at,
            t_at,
        }
    }

    /// The message with `seq` and `t` written in.
    pub(crate) fn stamp(&mut self, seq: u64, t: u64) -> &[u8] {
        write_digits(&mut self.bytes[self.seq_at..self.seq_at + DIGITS], seq);
        write_digits(&mut self.bytes[self.t_at..self.t_at + DIGITS], t);
        &self.bytes
    }

    /// The message size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }
}

fn write_digits(dst: &mut [u8], mut v: u64) {
    for d in dst.iter_mut().rev() {
        *d = b'0' + (v % 10) as u8;
        v /= 10;
    }
}

fn read_digits(src: &[u8]) -> Option<u64> {
    let mut v: u64 = 0;
    for &d in src {
        if !d.is_ascii_digit() {
            return None;
        }
        v = v.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    Some(v)
}

/// The sequence number and send time of a benchmark message, wherever it sits in `msg` (the
/// message may be wrapped in an envelope); `None` for anything else (replies, notifications).
pub(crate) fn parse_stamp(msg: &[u8]) -> Option<(u64, u64)> {
    let key = if msg.starts_with(b"{\"seq\":") {
        1
    } else {
        memmem::find(msg, SEQ_KEY)?
    };
    let seq_at = key + SEQ_KEY.len();
    let t_key = seq_at + DIGITS;
    let t_at = t_key + T_KEY.len();
    if msg.len() < t_at + DIGITS || &msg[t_key..t_at] != T_KEY {
        return None;
    }
    Some((
        read_digits(&msg[seq_at..seq_at + DIGITS])?,
        read_digits(&msg[t_at..t_at + DIGITS])?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_has_exact_size_and_round_trips() {
        for size in [64, 1024, 8192] {
            let mut t = Template::new(size, "");
            assert_eq!(t.len(), size);
            let msg = t.stamp(42, 1_234_567_890_123).to_vec();
            assert_eq!(parse_stamp(&msg), Some((42, 1_234_567_890_123)));
            let v: serde_json::Value = serde_json::from_slice(&msg).expect("valid JSON");
            assert_eq!(v["seq"], 42);
        }
    }

    #[test]
    fn stamp_is_found_inside_an_envelope() {
        let mut t = Template::new(64, "\"type\":\"screenshot_update\",");
        let inner = t.stamp(7, 9).to_vec();
        let mut wrapped = b"{\"type\":\"message\",\"data\":".to_vec();
        wrapped.extend_from_slice(&inner);
        wrapped.push(b'}');
        assert_eq!(parse_stamp(&wrapped), Some((7, 9)));
        assert_eq!(parse_stamp(b"{\"type\":\"pong\"}"), None);
    }
}
