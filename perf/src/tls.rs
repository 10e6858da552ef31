//! TLS for the systems that run over it (`powerhub-tls`, `nats-tls`): a test CA and server
//! certificate made at start, the rustls client configuration that trusts it, and the client
//! sides the load generator drives: a blocking [`Link`] for handshakes and confirmations, a
//! non-blocking [`SubStream`] for subscriber fleets, and a [`TlsWriter`] for publishers.
//!
//! Every system is measured through the same rustls client (ring provider, TLS 1.3), so the
//! client's cost is the same on both sides of a ratio.

use std::io::{self, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use mio::net::TcpStream as MioStream;
use rustls::pki_types::{CertificateDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore};

/// The certificate files of a run and the client configuration that trusts them.
#[derive(Debug, Clone)]
pub(crate) struct TlsFiles {
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    pub(crate) client: Arc<ClientConfig>,
}

impl TlsFiles {
    /// Makes a CA and a server certificate for `localhost` and `127.0.0.1` (ECDSA P-256, as
    /// `scripts/make-test-certs.sh` makes them) in `dir`.
    pub(crate) fn make(dir: &Path) -> io::Result<TlsFiles> {
        let err = |e: rcgen::Error| io::Error::other(format!("making test certificates: {e}"));
        let ca_key = rcgen::KeyPair::generate().map_err(err)?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name = rcgen::DistinguishedName::new();
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, "powerhub-perf test CA");
        let ca = ca.self_signed(&ca_key).map_err(err)?;
        let key = rcgen::KeyPair::generate().map_err(err)?;
        let server = rcgen::CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
            .map_err(err)?
            .signed_by(&key, &ca, &ca_key)
            .map_err(err)?;
        let files = TlsFiles {
            cert: dir.join("perf-tls-server.pem"),
            key: dir.join("perf-tls-server.key"),
            client: client_config(ca.der().clone())?,
        };
        std::fs::write(&files.cert, server.pem())?;
        std::fs::write(&files.key, key.serialize_pem())?;
        Ok(files)
    }
}

fn client_config(ca: CertificateDer<'static>) -> io::Result<Arc<ClientConfig>> {
    let mut roots = RootCertStore::empty();
    roots
        .add(ca)
        .map_err(|e| io::Error::other(format!("the test CA: {e}")))?;
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| io::Error::other(format!("rustls: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
    Ok(Arc::new(config))
}

/// A TLS client connection to `localhost` over `tcp`, handshake not yet done (it happens on
/// the first read or write).
fn client(config: &Arc<ClientConfig>) -> io::Result<ClientConnection> {
    let name = ServerName::try_from("localhost").expect("a valid name");
    ClientConnection::new(Arc::clone(config), name).map_err(|e| io::Error::other(e.to_string()))
}

/// A blocking connection, plain or TLS: what handshakes, subscriptions and confirmations run
/// over.
pub(crate) enum Link {
    Plain(TcpStream),
    Tls {
        tcp: TcpStream,
        tls: Box<ClientConnection>,
        /// Plaintext read before the TLS upgrade (NATS's `INFO`), read again first.
        replay: Vec<u8>,
    },
}

impl Link {
    /// TLS over `tcp`; `replay` is what was read in plaintext before it.
    pub(crate) fn tls(
        tcp: TcpStream,
        config: &Arc<ClientConfig>,
        replay: Vec<u8>,
    ) -> io::Result<Link> {
        Ok(Link::Tls {
            tcp,
            tls: Box::new(client(config)?),
            replay,
        })
    }

    /// The same connection, read without blocking by a subscriber fleet (`leftover` is
    /// plaintext already read past the subscription's confirmation).
    pub(crate) fn into_sub(self) -> io::Result<SubStream> {
        let tcp = match &self {
            Link::Plain(tcp) | Link::Tls { tcp, .. } => tcp,
        };
        tcp.set_nonblocking(true)?;
        Ok(match self {
            Link::Plain(tcp) => SubStream::Plain(MioStream::from_std(tcp)),
            Link::Tls { tcp, tls, .. } => SubStream::Tls {
                tcp: MioStream::from_std(tcp),
                tls,
            },
        })
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Plain(tcp) => tcp.read(buf),
            Link::Tls { tcp, tls, replay } => {
                if !replay.is_empty() {
                    let n = buf.len().min(replay.len());
                    buf[..n].copy_from_slice(&replay[..n]);
                    replay.drain(..n);
                    return Ok(n);
                }
                rustls::Stream::new(&mut **tls, tcp).read(buf)
            }
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Link::Plain(tcp) => tcp.write(buf),
            Link::Tls { tcp, tls, .. } => rustls::Stream::new(&mut **tls, tcp).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Link::Plain(tcp) => tcp.flush(),
            Link::Tls { tcp, tls, .. } => rustls::Stream::new(&mut **tls, tcp).flush(),
        }
    }
}

/// A subscriber's connection, read without blocking.
pub(crate) enum SubStream {
    Plain(MioStream),
    Tls {
        tcp: MioStream,
        tls: Box<ClientConnection>,
    },
}

impl SubStream {
    /// The socket, to register for readiness.
    pub(crate) fn socket(&mut self) -> &mut MioStream {
        match self {
            SubStream::Plain(tcp) | SubStream::Tls { tcp, .. } => tcp,
        }
    }

    /// Reads plaintext as a non-blocking socket read does: `WouldBlock` when nothing is there.
    pub(crate) fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            SubStream::Plain(tcp) => tcp.read(buf),
            SubStream::Tls { tcp, tls } => loop {
                match tls.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
                // No plaintext buffered: take records from the socket.
                if tls.read_tls(tcp)? == 0 {
                    return Ok(0);
                }
                tls.process_new_packets()
                    .map_err(|e| io::Error::other(format!("TLS: {e}")))?;
                flush_tls(tls, tcp)?;
            },
        }
    }

    /// Writes a (small) reply in full.
    pub(crate) fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            SubStream::Plain(tcp) => write_all_nonblocking(tcp, bytes),
            SubStream::Tls { tcp, tls } => {
                tls.writer().write_all(bytes)?;
                flush_tls(tls, tcp)
            }
        }
    }
}

/// Writes what rustls has to send to a non-blocking socket, waiting out a full buffer.
fn flush_tls(tls: &mut ClientConnection, tcp: &mut MioStream) -> io::Result<()> {
    while tls.wants_write() {
        match tls.write_tls(tcp) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn write_all_nonblocking(tcp: &mut MioStream, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        match tcp.write(bytes) {
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::thread::yield_now(),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A publisher's TLS connection: the writing thread encrypts and writes; a second thread reads
/// (and drops) what the server sends, so that replies never back up. They share the rustls
/// state under a lock, held only to encrypt or decrypt, never across a socket call.
pub(crate) struct TlsWriter {
    tcp: TcpStream,
    tls: Arc<Mutex<ClientConnection>>,
    ciphertext: Vec<u8>,
}

impl TlsWriter {
    /// Splits a handshaken TLS link; `None` for a plain one.
    pub(crate) fn from_link(link: Link) -> io::Result<Result<TlsWriter, TcpStream>> {
        let (tcp, tls) = match link {
            Link::Plain(tcp) => return Ok(Err(tcp)),
            Link::Tls { tcp, tls, .. } => (tcp, tls),
        };
        tcp.set_read_timeout(None)?;
        let tls = Arc::new(Mutex::new(*tls));
        let mut reader = tcp.try_clone()?;
        let shared = Arc::clone(&tls);
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 64 << 10];
            let mut plain = vec![0u8; 64 << 10];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut tls = shared.lock().expect("not poisoned");
                let mut records = &buf[..n];
                while !records.is_empty() {
                    if tls.read_tls(&mut records).is_err() || tls.process_new_packets().is_err() {
                        return;
                    }
                    while matches!(tls.reader().read(&mut plain), Ok(n) if n > 0) {}
                }
            }
        });
        Ok(Ok(TlsWriter {
            tcp,
            tls,
            ciphertext: Vec::with_capacity(1 << 20),
        }))
    }

    /// Encrypts `bytes` and writes the records, as much as rustls takes at a time (its buffer
    /// is bounded).
    pub(crate) fn write_all(&mut self, mut bytes: &[u8]) -> io::Result<()> {
        while !bytes.is_empty() {
            self.ciphertext.clear();
            {
                let mut tls = self.tls.lock().expect("not poisoned");
                let n = tls.writer().write(bytes)?;
                bytes = &bytes[n..];
                while tls.wants_write() {
                    tls.write_tls(&mut self.ciphertext)?;
                }
            }
            self.tcp.write_all(&self.ciphertext)?;
        }
        Ok(())
    }

    /// Ends the sending side.
    pub(crate) fn shutdown(&self) {
        let _ = self.tcp.shutdown(std::net::Shutdown::Write);
    }
}
