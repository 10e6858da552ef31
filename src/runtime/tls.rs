//! TLS on a shard's connection: the record layer between the connection's plaintext (what the
//! protocol decodes, what the outbox and the urgent queue write) and its socket.
//!
//! The shard stays the only one doing IO: received bytes go through [`TlsLayer::receive`] into
//! the connection's input buffer, and a send encrypts what the urgent queue and the outbox offer
//! ([`TlsLayer::encrypt`]) into one ciphertext buffer, written as the send's one chunk. rustls
//! takes every plaintext byte offered (its buffer limit is off), so plaintext counts as written
//! once encrypted and the outbox's rules apply up to the TLS layer; the ciphertext buffer is
//! bounded, since nothing more is encrypted until it is written out: a stalled TLS reader holds
//! at most one transmit of the outbox ([`ENCODE_AHEAD`](crate::outbox), or the one message that
//! crosses it) as ciphertext beyond the outbox's reach. The shard tells the connection what the
//! socket refused of it
//! ([`PushConnection::on_below_written`](crate::push::PushConnection::on_below_written)), so
//! that ciphertext counts with its output for the stall and `max_outbox_bytes`, and what the
//! socket takes after a refusal is drain progress.

use std::sync::Arc;
use std::time::SystemTime;

use bytes::{Buf, Bytes, BytesMut};
use rustls::ServerConfig;

use crate::security::tls::{PeerSubject, TlsSession, TlsSessionError};

/// One connection's TLS state (boxed in the connection: plaintext connections pay 8 bytes).
pub(crate) struct TlsLayer {
    session: TlsSession,
    /// Ciphertext taken from the session and not yet written (the send in flight holds a clone
    /// of it).
    pub(crate) pending: Bytes,
    /// `close_notify` was queued.
    close_notified: bool,
    /// The session failed (a broken record, a refused handshake): only its alert goes out.
    pub(crate) failed: bool,
    /// Reused for decrypted bytes and taken ciphertext.
    scratch: Vec<u8>,
    /// Plaintext bytes encrypted since ciphertext was last taken.
    encrypted: usize,
}

impl std::fmt::Debug for TlsLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsLayer")
            .field("session", &self.session)
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl TlsLayer {
    pub(crate) fn new(config: Arc<ServerConfig>) -> Result<TlsLayer, TlsSessionError> {
        let mut session = TlsSession::new(config)?;
        // The shard bounds what is encrypted (one transmit of the outbox, and nothing more until
        // its ciphertext is written), so rustls's own 64 KiB bound only cut transmits short: the
        // outbox took that for a socket refusing bytes and paused.
        session.connection_mut().set_buffer_limit(None);
        Ok(TlsLayer {
            session,
            pending: Bytes::new(),
            close_notified: false,
            failed: false,
            scratch: Vec::new(),
            encrypted: 0,
        })
    }

    /// Decrypts what the socket delivered, appending the plaintext to `input`. Returns whether
    /// the peer sent `close_notify`. On an error the connection is over; the alert rustls
    /// queued is in [`TlsLayer::pending`] once [`TlsLayer::take_ciphertext`] ran.
    pub(crate) fn receive(
        &mut self,
        data: &[u8],
        input: &mut BytesMut,
    ) -> Result<bool, TlsSessionError> {
        self.scratch.clear();
        let received = self.session.receive(data, &mut self.scratch);
        if !self.scratch.is_empty() {
            crate::push::append_input(input, &self.scratch);
        }
        self.shrink_scratch();
        received.map(|r| r.peer_closed)
    }

    /// Encrypts `parts` in order, in records as full as the parts allow (not one per part);
    /// returns how many plaintext bytes rustls took: all of them, its buffer being unbounded
    /// (the shard offers one transmit at a time).
    pub(crate) fn encrypt(&mut self, parts: &[Bytes]) -> usize {
        let taken = self.session.send_vectored(parts);
        self.encrypted += taken;
        taken
    }

    /// Moves everything rustls has to send (handshake messages, records, alerts) behind
    /// [`TlsLayer::pending`].
    pub(crate) fn take_ciphertext(&mut self) {
        if !self.session.wants_write() {
            return;
        }
        self.scratch.clear();
        // Room for the records of what was encrypted since (a 16 KiB record adds 22 bytes; 64
        // more per record for alerts and tickets) at once: grown from nothing, the buffer would
        // be copied at every doubling.
        let plain = std::mem::take(&mut self.encrypted);
        let records = plain / (16 << 10) + 1;
        self.scratch
            .reserve(self.pending.len() + plain + records * 64 + 256);
        if !self.pending.is_empty() {
            crate::copy::put(&mut self.scratch, &self.pending);
        }
        self.session.take_ciphertext(&mut self.scratch);
        self.pending = Bytes::from(std::mem::take(&mut self.scratch));
    }

    /// `n` bytes of [`TlsLayer::pending`] were written.
    pub(crate) fn written(&mut self, n: usize) {
        self.pending.advance(n.min(self.pending.len()));
    }

    /// Whether rustls holds ciphertext not yet taken, or some is pending.
    pub(crate) fn has_output(&self) -> bool {
        !self.pending.is_empty() || self.session.wants_write()
    }

    /// The subject of the client certificate the handshake verified (mutual TLS), if any.
    pub(crate) fn peer_subject(&self) -> Option<PeerSubject> {
        self.session.peer_subject()?.ok()
    }

    /// When the client certificate chain the handshake verified stops being valid, if the
    /// client presented one.
    pub(crate) fn peer_valid_until(&self, now: SystemTime) -> Option<SystemTime> {
        self.session.peer_valid_until(now)
    }

    /// Whether the handshake is done, so that plaintext goes out as it is encrypted.
    pub(crate) fn is_handshaking(&self) -> bool {
        self.session.is_handshaking()
    }

    /// Queues `close_notify`, once; returns whether it was queued now.
    pub(crate) fn close_notify(&mut self) -> bool {
        if std::mem::replace(&mut self.close_notified, true) {
            return false;
        }
        self.session.close();
        self.take_ciphertext();
        true
    }

    fn shrink_scratch(&mut self) {
        if self.scratch.capacity() > 64 << 10 {
            self.scratch = Vec::new();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::security::tls::server_config_with;
    use crate::security::tls::tests::{client_config, files, pki, pump, reader};

    /// The shard hands one transmit of the outbox (its write bound, 64 KiB, plus the message
    /// that crosses it, which may be large) to the layer: it is encrypted whole, however much
    /// it is, so that the outbox never reads rustls's buffer as a socket refusing bytes (and
    /// pauses, re-admitting its queue message by message, at every send).
    #[test]
    fn one_transmit_is_encrypted_whole_past_rustls_buffer_limit() {
        let pki = pki();
        let config = server_config_with(&files(false), reader(&pki)).unwrap();
        let mut layer = TlsLayer::new(config).unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut client = rustls::ClientConnection::new(
            client_config(&pki, false, &[&rustls::version::TLS13]),
            name,
        )
        .unwrap();
        pump(&mut client, &mut layer.session, &mut Vec::new()).unwrap();
        assert!(!layer.is_handshaking());
        let parts: Vec<Bytes> = (0..300).map(|_| Bytes::from(vec![b'x'; 1024])).collect();
        assert_eq!(layer.encrypt(&parts), 300 * 1024);
        layer.take_ciphertext();
        assert!(layer.pending.len() > 300 * 1024, "{}", layer.pending.len());
    }
}
