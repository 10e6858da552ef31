//! Large copies made in pieces of at most [`PIECE`] bytes.
//!
//! glibc (2.36, Debian 12's) copies more than about 2 KiB with `rep movsb` on CPUs that announce
//! fast short `rep movsb`. On AMD Zen 3 and 4 that instruction runs at a tenth of the vector
//! loop's speed or less whenever the destination lies 1 to 15 bytes past the source modulo 4 KiB
//! (glibc bug 30994; later glibc releases stop using it there). The TLS record layer meets that
//! case more often than by chance: a record's payload starts 5 bytes into its buffer. On this
//! project's benchmark machine (an AMD EPYC with glibc 2.36), a TLS fan-out spent 41 % of the
//! server's CPU in that instruction; `cargo bench --bench copy` shows the two ways side by side.
//! A piece of at most [`PIECE`] bytes is copied by the vector loop at any offset.
//!
//! Copies made inside rustls stay whole where the caller does not choose their size: plaintext
//! held back during the handshake, received ciphertext taken into rustls's buffer, and each
//! decrypted record. The send side, where a fan-out's bytes go, is cut here in full.

use bytes::BufMut;

/// The largest copy made at once: glibc takes `rep movsb` for copies of more than its
/// threshold, 2 112 bytes on CPUs with fast short `rep movsb` and 2 048 or more elsewhere.
pub(crate) const PIECE: usize = 2048;

/// Appends `src` to `dst` (a `Vec<u8>` or a `BytesMut`), a piece at a time. The caller makes
/// room first: grown piece by piece, the buffer would be copied whole at each doubling.
#[inline]
pub(crate) fn put(dst: &mut impl BufMut, src: &[u8]) {
    for piece in src.chunks(PIECE) {
        dst.put_slice(piece);
    }
}

/// An [`std::io::Write`] that appends to a `Vec` a piece at a time (what rustls writes its
/// records through).
pub(crate) struct Pieces<'a>(pub(crate) &'a mut Vec<u8>);

impl std::io::Write for Pieces<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.reserve(buf.len());
        put(self.0, buf);
        Ok(buf.len())
    }

    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        let len = bufs.iter().map(|b| b.len()).sum();
        self.0.reserve(len);
        for buf in bufs {
            put(self.0, buf);
        }
        Ok(len)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::BytesMut;
    use std::io::Write;

    #[test]
    fn a_copy_in_pieces_appends_exactly_the_source() {
        let src: Vec<u8> = (0..3 * PIECE + 17).map(|i| (i % 251) as u8).collect();
        let mut v = b"head".to_vec();
        put(&mut v, &src);
        assert_eq!(&v[..4], b"head");
        assert_eq!(&v[4..], &src[..]);
        let mut b = BytesMut::from(&b"head"[..]);
        put(&mut b, &src);
        assert_eq!(&b[4..], &src[..]);
        let mut w = Vec::new();
        let parts = [
            std::io::IoSlice::new(&src[..5]),
            std::io::IoSlice::new(&src[5..]),
        ];
        assert_eq!(Pieces(&mut w).write_vectored(&parts).unwrap(), src.len());
        assert_eq!(w, src);
    }
}
