//! TLS on a shard's connection: the record layer between the connection's plaintext (what the
//! protocol decodes, what the outbox and the urgent queue write) and its socket.
//!
//! The shard stays the only one doing IO: received bytes go through [`TlsLayer::receive`] into
//! the connection's input buffer, and a send encrypts what the urgent queue and the outbox offer
//! ([`TlsLayer::encrypt`]) into one ciphertext buffer, written as the send's one chunk. Plaintext
//! counts as written once rustls took it, so the outbox's rules apply up to the TLS buffer; the
//! ciphertext buffer is bounded, since nothing more is encrypted until it is written out: a
//! stalled TLS reader holds at most one batch (about [`ENCODE_AHEAD`](crate::outbox) plus
//! rustls's 64 KiB) beyond the outbox's reach, as a plaintext one holds its kernel buffer.

use std::sync::Arc;

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
    /// The socket refused part of the last ciphertext written: the connection is stalled, as a
    /// plaintext one whose outbox wants writability.
    pub(crate) stalled: bool,
    /// Reused for decrypted bytes and taken ciphertext.
    scratch: Vec<u8>,
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
        Ok(TlsLayer {
            session: TlsSession::new(config)?,
            pending: Bytes::new(),
            close_notified: false,
            failed: false,
            stalled: false,
            scratch: Vec::new(),
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
            input.extend_from_slice(&self.scratch);
        }
        self.shrink_scratch();
        received.map(|r| r.peer_closed)
    }

    /// Encrypts `parts` in order until rustls's buffer is full; returns how many plaintext bytes
    /// it took (of the parts' total).
    pub(crate) fn encrypt(&mut self, parts: &[Bytes]) -> usize {
        let mut taken = 0;
        for part in parts {
            let n = self.session.send(part);
            taken += n;
            if n < part.len() {
                break;
            }
        }
        taken
    }

    /// Moves everything rustls has to send (handshake messages, records, alerts) behind
    /// [`TlsLayer::pending`].
    pub(crate) fn take_ciphertext(&mut self) {
        if !self.session.wants_write() {
            return;
        }
        self.scratch.clear();
        if !self.pending.is_empty() {
            self.scratch.extend_from_slice(&self.pending);
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
