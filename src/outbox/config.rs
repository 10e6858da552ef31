//! Outbox configuration and its validation.

use std::time::Duration;

/// How an outbox frames what it writes.
///
/// A push connection speaks one stream protocol. With [`Framing::Ndjson`] the outbox writes a JSON
/// message followed by `\n` itself and writes shared chunks of NDJSON lines (the hub's shared
/// batch frame) as they are: no parse, no copy, the same `Bytes` for every subscriber. With
/// [`Framing::Protocol`] every message goes through the connection's
/// [`StreamProtocol::encode_text`](powerhub_plugin::StreamProtocol::encode_text) (a WebSocket
/// text frame per message), and a shared chunk is split into its lines to be framed one by one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Framing {
    /// Every message is framed by the connection's `StreamProtocol` (always correct).
    #[default]
    Protocol,
    /// The connection's wire form is NDJSON, so lines are written as they are (zero copy). Only
    /// for connections whose `StreamProtocol::encode_text` appends exactly `\n`.
    Ndjson,
}

/// The settings of an [`Outbox`](super::Outbox), with the spec's values as defaults.
///
/// ```
/// use std::time::Duration;
/// use powerhub::outbox::OutboxConfig;
///
/// let config = OutboxConfig::default();
/// assert_eq!(config.high_water_bytes, 8 << 20);
/// assert_eq!(config.keepalive_interval, Duration::from_secs(15));
/// assert_eq!(config.liveness_timeout, Duration::from_secs(45));
/// assert!(config.validate().is_ok());
///
/// let bad = OutboxConfig { high_water_bytes: 0, ..OutboxConfig::default() };
/// assert!(bad.validate().unwrap_err().to_string().contains("high_water_bytes"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxConfig {
    /// Message types that keep only the latest message per slot (subscription, deviceId,
    /// deviceSessionUuid, type) while the connection is paused. Default: `screenshot_update`,
    /// `hierarchy_update`. A message carrying `id` or `requestId` is never coalesced.
    pub coalesce_types: Vec<String>,
    /// Message types replaced by a `frames_dropped` notification while more than
    /// [`high_water_bytes`](Self::high_water_bytes) are unsent. Default: `screenshot_update`.
    /// A message carrying `id` or `requestId` is never dropped.
    pub drop_types: Vec<String>,
    /// The unsent-bytes threshold (the spec's 8 MiB `socket.writableLength`) above which
    /// [`drop_types`](Self::drop_types) messages are dropped. Not a frame size limit: a single
    /// message larger than this is written unchanged. Default: 8 MiB.
    pub high_water_bytes: usize,
    /// How often a keepalive ping is queued, whatever the connection's state. Default: 15 s.
    pub keepalive_interval: Duration,
    /// How long a connection may go without an inbound pong or drain progress before it is
    /// reaped. Must be longer than `keepalive_interval`. Default: 45 s.
    pub liveness_timeout: Duration,
    /// How messages are framed. Default: [`Framing::Protocol`].
    pub framing: Framing,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            coalesce_types: vec!["screenshot_update".into(), "hierarchy_update".into()],
            drop_types: vec!["screenshot_update".into()],
            high_water_bytes: 8 << 20,
            keepalive_interval: Duration::from_secs(15),
            liveness_timeout: Duration::from_secs(45),
            framing: Framing::Protocol,
        }
    }
}

/// Why an [`OutboxConfig`] was rejected; each variant names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OutboxConfigError {
    /// `high_water_bytes` is zero.
    #[error("high_water_bytes must be at least 1 byte, got 0")]
    ZeroHighWater,
    /// `keepalive_interval` is zero.
    #[error("keepalive_interval must be longer than zero")]
    ZeroKeepalive,
    /// `liveness_timeout` is not longer than `keepalive_interval`.
    #[error(
        "liveness_timeout ({liveness:?}) must be longer than keepalive_interval ({keepalive:?}), \
         so that a pong can arrive"
    )]
    LivenessTooShort {
        /// The configured liveness timeout.
        liveness: Duration,
        /// The configured keepalive interval.
        keepalive: Duration,
    },
    /// An entry of `coalesce_types` or `drop_types` is empty.
    #[error("{field} contains an empty type name")]
    EmptyType {
        /// `coalesce_types` or `drop_types`.
        field: &'static str,
    },
}

impl OutboxConfig {
    /// Checks every field; the error names the first field that is wrong.
    pub fn validate(&self) -> Result<(), OutboxConfigError> {
        if self.high_water_bytes == 0 {
            return Err(OutboxConfigError::ZeroHighWater);
        }
        if self.keepalive_interval.is_zero() {
            return Err(OutboxConfigError::ZeroKeepalive);
        }
        if self.liveness_timeout <= self.keepalive_interval {
            return Err(OutboxConfigError::LivenessTooShort {
                liveness: self.liveness_timeout,
                keepalive: self.keepalive_interval,
            });
        }
        if self.coalesce_types.iter().any(String::is_empty) {
            return Err(OutboxConfigError::EmptyType {
                field: "coalesce_types",
            });
        }
        if self.drop_types.iter().any(String::is_empty) {
            return Err(OutboxConfigError::EmptyType {
                field: "drop_types",
            });
        }
        Ok(())
    }

    pub(crate) fn is_coalescible(&self, ty: &str) -> bool {
        self.coalesce_types.iter().any(|t| t == ty)
    }

    pub(crate) fn is_droppable(&self, ty: &str) -> bool {
        self.drop_types.iter().any(|t| t == ty)
    }

    /// Whether no message of `lines` (complete JSON messages) can be of a coalesced or dropped
    /// type, so that all are lossless FIFO. Without escapes a message of type `T` holds `T`'s
    /// bytes, so the answer is yes when the chunk has no backslash and names none of those
    /// types anywhere; a name inside a payload, or any escape, answers no (the caller then
    /// classifies each message).
    pub(crate) fn all_lossless(&self, lines: &[u8]) -> bool {
        memchr::memchr(b'\\', lines).is_none()
            && !self
                .coalesce_types
                .iter()
                .chain(&self.drop_types)
                .any(|t| memchr::memmem::find(lines, t.as_bytes()).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::OutboxConfig;

    /// A chunk is lossless as a whole only when no message can be of a coalesced or dropped
    /// type: a name anywhere, or an escape (which could spell one), sends it to the rules.
    #[test]
    fn a_chunk_is_all_lossless_only_when_it_can_name_no_ruled_type() {
        let c = OutboxConfig::default();
        assert!(c.all_lossless(b"{\"type\":\"device_lifecycle\"}\n{\"type\":\"x\"}\n"));
        assert!(!c.all_lossless(b"{\"type\":\"x\"}\n{\"type\":\"screenshot_update\"}\n"));
        assert!(!c.all_lossless(b"{\"type\":\"hierarchy_update\",\"id\":1}\n"));
        assert!(!c.all_lossless(b"{\"type\":\"x\",\"note\":\"hierarchy_update\"}\n"));
        assert!(!c.all_lossless(b"{\"type\":\"screenshot\\u005fupdate\"}\n"));
    }
}
