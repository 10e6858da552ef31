//! The benchmark message: a JSON object carrying a sequence number and a send time in
//! fixed-width decimal fields, padded to an exact size.
//!
//! ```text
//! {"s":       42,"t":   123456789,"stream":"b","type":"t","p":"x"}
//! ```
//!
//! (JSON allows whitespace before a value but no leading zeros, so numbers are right-aligned
//! with spaces.)
//!
//! `stream` and `type` are what the push protocol needs to route a published message; every
//! system receives byte-identical messages. Fixed widths let the publisher stamp a pre-encoded
//! template in place (no re-encoding per message) and let readers parse both numbers at fixed
//! offsets without a JSON parser. The 64-byte bench message is exactly 64 bytes.

const PREFIX: &[u8] = b"{\"s\":";
const T_KEY: &[u8] = b",\"t\":";
const SEQ_DIGITS: usize = 9;
const T_DIGITS: usize = 12;
const SEQ_AT: usize = PREFIX.len();
const T_KEY_AT: usize = SEQ_AT + SEQ_DIGITS;
const T_AT: usize = T_KEY_AT + T_KEY.len();
const STAMP_END: usize = T_AT + T_DIGITS;
/// The time field's period: a stamped time wraps past it (1000 s of nanoseconds).
const T_PERIOD: u64 = 10u64.pow(T_DIGITS as u32);

/// A message template that is stamped in place.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    bytes: Vec<u8>,
}

impl Template {
    /// A message of exactly `size` bytes (or the smallest possible, if `size` is smaller) on
    /// `stream` with `type` `kind`, with `extra` (a run of `,"key":value` pairs) before the
    /// padding field.
    pub(crate) fn new(size: usize, stream: &str, kind: &str, extra: &str) -> Template {
        let mut bytes = Vec::with_capacity(size);
        bytes.extend_from_slice(PREFIX);
        bytes.extend_from_slice(&[b' '; SEQ_DIGITS]);
        bytes.extend_from_slice(T_KEY);
        bytes.extend_from_slice(&[b' '; T_DIGITS]);
        bytes.extend_from_slice(
            format!(",\"stream\":\"{stream}\",\"type\":\"{kind}\"{extra},\"p\":\"").as_bytes(),
        );
        let fixed = bytes.len() + 2;
        bytes.resize(bytes.len() + size.saturating_sub(fixed), b'x');
        bytes.extend_from_slice(b"\"}");
        Template { bytes }
    }

    /// The message with `seq` and `t` written in (values past the field width wrap).
    pub(crate) fn stamp(&mut self, seq: u64, t: u64) -> &[u8] {
        write_digits(&mut self.bytes[SEQ_AT..T_KEY_AT], seq);
        write_digits(&mut self.bytes[T_AT..STAMP_END], t);
        &self.bytes
    }

    /// The message size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.bytes.len()
    }
}

fn write_digits(dst: &mut [u8], mut v: u64) {
    for (i, d) in dst.iter_mut().rev().enumerate() {
        *d = if i == 0 || v > 0 {
            b'0' + (v % 10) as u8
        } else {
            b' '
        };
        v /= 10;
    }
}

fn read_digits(src: &[u8]) -> Option<u64> {
    let mut v: u64 = 0;
    let digits = &src[src.iter().position(|&d| d != b' ')?..];
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        v = v * 10 + u64::from(d - b'0');
    }
    Some(v)
}

/// The sequence number and send time of a benchmark message; `None` for anything else
/// (replies, notifications such as `frames_dropped`).
/// Nanoseconds from a stamped time `t` (as read back from a message: wrapped to the field) to
/// `now`. Right for any message younger than the field's period (1000 s), however long the
/// process has run: a run that goes on past 1000 s wraps its stamps.
pub(crate) fn since(t: u64, now: u64) -> u64 {
    (now % T_PERIOD + T_PERIOD - t % T_PERIOD) % T_PERIOD
}

pub(crate) fn parse_stamp(msg: &[u8]) -> Option<(u64, u64)> {
    if msg.len() < STAMP_END || !msg.starts_with(PREFIX) || &msg[T_KEY_AT..T_AT] != T_KEY {
        return None;
    }
    Some((
        read_digits(&msg[SEQ_AT..T_KEY_AT])?,
        read_digits(&msg[T_AT..STAMP_END])?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_has_exact_size_and_round_trips() {
        for size in [64, 1024, 8192] {
            let mut t = Template::new(size, "b", "t", "");
            assert_eq!(t.len(), size);
            let msg = t.stamp(42, 1_234_567_890).to_vec();
            assert_eq!(parse_stamp(&msg), Some((42, 1_234_567_890)));
            let v: serde_json::Value = serde_json::from_slice(&msg).expect("valid JSON");
            assert_eq!(v["s"], 42);
            assert_eq!(v["stream"], "b");
            let msg = t.stamp(0, 0).to_vec();
            assert_eq!(parse_stamp(&msg), Some((0, 0)));
            assert!(serde_json::from_slice::<serde_json::Value>(&msg).is_ok());
        }
    }

    #[test]
    fn other_messages_have_no_stamp() {
        let mut t = Template::new(300, "screens", "screenshot_update", ",\"deviceId\":\"d1\"");
        let msg = t.stamp(7, 9).to_vec();
        let v: serde_json::Value = serde_json::from_slice(&msg).expect("valid JSON");
        assert_eq!(v["deviceId"], "d1");
        assert_eq!(parse_stamp(&msg), Some((7, 9)));
        assert_eq!(parse_stamp(b"{\"type\":\"frames_dropped\"}"), None);
    }

    #[test]
    fn latency_stays_right_once_the_clock_passes_the_time_fields_width() {
        let mut t = Template::new(64, "bench", "t", "");
        let sent = 3 * super::T_PERIOD - 10;
        let msg = t.stamp(1, sent).to_vec();
        let (_, stamped) = parse_stamp(&msg).expect("stamped");
        assert_eq!(super::since(stamped, sent + 25), 25, "before the wrap");
        let msg = t.stamp(2, sent + 20).to_vec();
        let (_, stamped) = parse_stamp(&msg).expect("stamped");
        assert_eq!(stamped, 10, "the field wrapped");
        assert_eq!(super::since(stamped, sent + 45), 25, "across the wrap");
    }
}
