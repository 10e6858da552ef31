//! TLS for the TCP listeners: a rustls [`ServerConfig`] built from a listener's `tls_cert`,
//! `tls_key` and optional `tls_client_ca` PEM files, and [`TlsSession`], a sans-IO wrapper around
//! [`rustls::ServerConnection`] that a shard drives with the bytes it reads and writes.
//!
//! - TLS 1.3 and 1.2, on rustls's `ring` provider; no async runtime anywhere.
//! - With `tls_client_ca`, every client must present a certificate issued by that CA (mutual
//!   TLS); [`TlsSession::peer_subject`] then gives the certificate's subject, whose
//!   [`PeerSubject::user`] is the connection's user.
//! - A [`ServerConfig`] is immutable and each connection holds its own `Arc` to it: reloading
//!   certificates (SIGHUP) is building a new one for the connections accepted from then on, while
//!   the open ones keep the one they started with.
//!
//! How a shard drives a connection:
//!
//! ```
//! # use std::sync::Arc;
//! # fn demo(config: Arc<rustls::ServerConfig>, socket_bytes: &[u8]) -> Result<(), Box<dyn std::error::Error>> {
//! use powerhub::security::tls::TlsSession;
//!
//! let mut tls = TlsSession::new(config)?;
//! let mut plaintext = Vec::new(); // what the protocol parser reads
//! let mut to_socket = Vec::new(); // what the shard writes to the socket
//!
//! // A read completed: feed what arrived, hand the protocol whatever it decrypted to.
//! let received = tls.receive(socket_bytes, &mut plaintext)?;
//! // The protocol answered: encrypt (before the handshake ends, rustls holds it back).
//! let reply = b"{\"type\":\"pong\"}\n";
//! let accepted = tls.send(reply); // less than all: write what is taken out, offer the rest later
//! # let _ = accepted;
//! // Whatever rustls has to say (handshake messages, records, alerts) goes to the socket.
//! tls.take_ciphertext(&mut to_socket);
//! if received.peer_closed {
//!     tls.close();
//!     tls.take_ciphertext(&mut to_socket);
//! }
//! # Ok(()) }
//! ```

use std::fmt;
use std::io::{self, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{ProtocolVersion, RootCertStore, ServerConfig, ServerConnection};
use x509_cert::der::asn1::{Ia5StringRef, PrintableStringRef, TeletexStringRef, Utf8StringRef};
use x509_cert::der::oid::ObjectIdentifier;
use x509_cert::der::{self, Decode as _, Reader as _, Tag, Tagged as _};

use crate::copy;

/// The most plaintext one TLS record carries (rustls's default fragment size).
const RECORD: usize = 16 << 10;

/// The listener keys this module reads, as a listener section names them.
pub const TLS_CERT_KEY: &str = "tls_cert";
/// See [`TLS_CERT_KEY`].
pub const TLS_KEY_KEY: &str = "tls_key";
/// See [`TLS_CERT_KEY`].
pub const TLS_CLIENT_CA_KEY: &str = "tls_client_ca";

/// The PEM files of one TLS listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// `tls_cert`: the server's certificate chain, end-entity certificate first.
    pub cert: PathBuf,
    /// `tls_key`: the certificate's private key (PKCS #8, PKCS #1 or SEC1).
    pub key: PathBuf,
    /// `tls_client_ca`: when set, clients must present a certificate issued by one of these CA
    /// certificates.
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// The TLS files of a listener from its three optional keys: `None` for a plaintext listener.
    ///
    /// # Errors
    ///
    /// [`TlsError::Incomplete`] when `tls_cert` comes without `tls_key` or the other way round,
    /// or `tls_client_ca` without either.
    ///
    /// ```
    /// use std::path::Path;
    /// use powerhub::security::tls::TlsFiles;
    ///
    /// assert_eq!(TlsFiles::from_listener_keys(None, None, None).unwrap(), None);
    /// let err = TlsFiles::from_listener_keys(Some(Path::new("cert.pem")), None, None).unwrap_err();
    /// assert_eq!(err.to_string(), "a listener with tls_cert needs tls_key too");
    /// ```
    pub fn from_listener_keys(
        tls_cert: Option<&Path>,
        tls_key: Option<&Path>,
        tls_client_ca: Option<&Path>,
    ) -> Result<Option<TlsFiles>, TlsError> {
        match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert: cert.to_owned(),
                key: key.to_owned(),
                client_ca: tls_client_ca.map(Path::to_owned),
            })),
            (Some(_), None) => Err(TlsError::Incomplete {
                given: TLS_CERT_KEY,
                missing: TLS_KEY_KEY,
            }),
            (None, Some(_)) => Err(TlsError::Incomplete {
                given: TLS_KEY_KEY,
                missing: TLS_CERT_KEY,
            }),
            (None, None) if tls_client_ca.is_some() => Err(TlsError::Incomplete {
                given: TLS_CLIENT_CA_KEY,
                missing: "tls_cert and tls_key",
            }),
            (None, None) => Ok(None),
        }
    }
}

/// Why a listener's TLS configuration could not be built, or a peer's certificate not read.
/// Names the listener key and file at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// One of the TLS keys is set without the one it needs.
    #[error("a listener with {given} needs {missing} too")]
    Incomplete {
        /// The key that is set.
        given: &'static str,
        /// The key(s) missing.
        missing: &'static str,
    },
    /// A file could not be read.
    #[error("{key} {}: cannot read: {source}", path.display())]
    Read {
        /// `tls_cert`, `tls_key` or `tls_client_ca`.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A file is not valid PEM.
    #[error("{key} {}: not a valid PEM file: {reason}", path.display())]
    Pem {
        /// The key naming the file.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What the PEM reader said.
        reason: String,
    },
    /// A certificate file holds no `CERTIFICATE` section.
    #[error("{key} {}: no CERTIFICATE in the file", path.display())]
    NoCertificate {
        /// `tls_cert` or `tls_client_ca`.
        key: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// A certificate does not parse.
    #[error("{key} {}: {reason}", path.display())]
    BadCertificate {
        /// `tls_cert` or `tls_client_ca`.
        key: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The key file holds no private key (`PRIVATE KEY`, `RSA PRIVATE KEY` or `EC PRIVATE KEY`).
    #[error("tls_key {}: no private key in the file", path.display())]
    NoPrivateKey {
        /// The file.
        path: PathBuf,
    },
    /// The key file holds only an encrypted key (`ENCRYPTED PRIVATE KEY`, or a PKCS #1 or SEC1
    /// key under `Proc-Type: 4,ENCRYPTED`): the server asks for no passphrase.
    #[error(
        "tls_key {}: the key is encrypted and the server reads no passphrase: give it the key \
         unencrypted (`openssl pkey -in KEY -out PLAIN_KEY`)",
        path.display()
    )]
    EncryptedPrivateKey {
        /// The file.
        path: PathBuf,
    },
    /// The private key is of a kind the TLS provider cannot sign with.
    #[error("tls_key {}: the key is not usable: {reason}", path.display())]
    BadPrivateKey {
        /// The file.
        path: PathBuf,
        /// What the provider said.
        reason: String,
    },
    /// The private key is not the certificate's.
    #[error("tls_key {} is not the key of the certificate in tls_cert {}", key.display(), cert.display())]
    KeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
    },
    /// A peer certificate's subject could not be read.
    #[error("the client certificate does not parse: {reason}")]
    PeerCertificate {
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the configuration for another reason.
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// An error on a TLS connection: the peer broke the protocol, failed the handshake or, with
/// mutual TLS, presented no acceptable certificate. The connection is to be closed; call
/// [`TlsSession::take_ciphertext`] once more first, to send the alert rustls queued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsSessionError {
    /// What rustls refused.
    #[error("TLS: {0}")]
    Protocol(#[from] rustls::Error),
    /// rustls could not take the bytes (its buffers are full: the peer sent a record larger
    /// than TLS allows).
    #[error("TLS: {0}")]
    Buffer(io::Error),
}

impl TlsSessionError {
    /// A short code for the close log: `tls_certificate` for a refused or missing client
    /// certificate, `tls_handshake` for other handshake failures, `tls_protocol` otherwise.
    pub fn code(&self) -> &'static str {
        match self {
            TlsSessionError::Protocol(
                rustls::Error::InvalidCertificate(_) | rustls::Error::NoCertificatesPresented,
            ) => "tls_certificate",
            TlsSessionError::Protocol(
                rustls::Error::PeerIncompatible(_) | rustls::Error::PeerMisbehaved(_),
            ) => "tls_handshake",
            _ => "tls_protocol",
        }
    }
}

/// The TLS provider of every listener: rustls on ring.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Builds the listener's TLS configuration, reading the files from the file system. With
/// `tls_client_ca` (mutual TLS) it resumes no session, so that every connection's certificate
/// chain is verified in full at its own handshake.
///
/// # Errors
///
/// See [`TlsError`]: a file missing or unreadable, not PEM, without a certificate or key, a key
/// the provider cannot use or that is not the certificate's, a CA certificate that does not
/// parse.
pub fn server_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_with(files, |p| std::fs::read(p))
}

/// [`server_config`], reading the files through `read`.
///
/// # Errors
///
/// As [`server_config`].
pub fn server_config_with(
    files: &TlsFiles,
    mut read: impl FnMut(&Path) -> io::Result<Vec<u8>>,
) -> Result<Arc<ServerConfig>, TlsError> {
    let mut read_file = |key: &'static str, path: &Path| {
        read(path).map_err(|source| TlsError::Read {
            key,
            path: path.to_owned(),
            source,
        })
    };
    let cert_pem = read_file(TLS_CERT_KEY, &files.cert)?;
    let chain = certificates(TLS_CERT_KEY, &files.cert, &cert_pem)?;
    let key_pem = read_file(TLS_KEY_KEY, &files.key)?;
    // An encrypted key: PKCS #8's `ENCRYPTED PRIVATE KEY`, or the legacy PEM encryption of a
    // PKCS #1 or SEC1 key (`Proc-Type: 4,ENCRYPTED`, which the PEM reader takes for bad base64).
    let encrypted = [
        &b"-----BEGIN ENCRYPTED PRIVATE KEY-----"[..],
        b"Proc-Type: 4,ENCRYPTED",
    ]
    .iter()
    .any(|marker| memchr::memmem::find(&key_pem, marker).is_some());
    let key = match PrivateKeyDer::from_pem_slice(&key_pem) {
        Ok(k) => k,
        Err(_) if encrypted => {
            return Err(TlsError::EncryptedPrivateKey {
                path: files.key.clone(),
            })
        }
        Err(pem::Error::NoItemsFound) => {
            return Err(TlsError::NoPrivateKey {
                path: files.key.clone(),
            })
        }
        Err(e) => {
            return Err(TlsError::Pem {
                key: TLS_KEY_KEY,
                path: files.key.clone(),
                reason: e.to_string(),
            })
        }
    };
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let ca_pem = read_file(TLS_CLIENT_CA_KEY, path)?;
            let mut roots = RootCertStore::empty();
            for cert in certificates(TLS_CLIENT_CA_KEY, path, &ca_pem)? {
                roots.add(cert).map_err(|e| TlsError::BadCertificate {
                    key: TLS_CLIENT_CA_KEY,
                    path: path.clone(),
                    reason: format!("not a usable CA certificate: {e}"),
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| TlsError::BadCertificate {
                    key: TLS_CLIENT_CA_KEY,
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| match e {
        rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
            TlsError::KeyMismatch {
                cert: files.cert.clone(),
                key: files.key.clone(),
            }
        }
        rustls::Error::InvalidCertificate(e) => TlsError::BadCertificate {
            key: TLS_CERT_KEY,
            path: files.cert.clone(),
            reason: format!("the certificate does not parse: {e}"),
        },
        e => TlsError::BadPrivateKey {
            path: files.key.clone(),
            reason: e.to_string(),
        },
    })?;
    if files.client_ca.is_some() {
        // Mutual TLS resumes no session: every connection's chain is verified in full, at its
        // own time, against the CA file in force. A resumed session would carry its chain
        // unverified, and where the first handshake skipped an expired extra certificate (a
        // cross-signed bundle's old intermediate) nothing tells it from one that expired since,
        // so each resumption of such a client would be closed at once.
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        config.send_tls13_tickets = 0;
    }
    Ok(Arc::new(config))
}

fn certificates(
    key: &'static str,
    path: &Path,
    pem_bytes: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem_bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            key,
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            key,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

/// Where a TLS listener's records are encrypted.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordLayer {
    /// rustls in user space, in the shard: the only one implemented. `kernel_offers_ktls` says
    /// whether this kernel lists the `tls` upper-layer protocol (`tcp_available_ulp`), under
    /// which the session keys could be handed to the kernel (kTLS) so that a shared frame went
    /// to it unencrypted, once per connection without a user-space copy.
    UserSpace {
        /// The kernel lists `tls` in `/proc/sys/net/ipv4/tcp_available_ulp`.
        kernel_offers_ktls: bool,
    },
}

impl RecordLayer {
    /// The record layer of this process's TLS listeners, with what the kernel offers.
    ///
    /// ```
    /// use powerhub::security::tls::RecordLayer;
    ///
    /// let RecordLayer::UserSpace { kernel_offers_ktls } = RecordLayer::current() else { unreachable!() };
    /// println!("kTLS offered by the kernel: {kernel_offers_ktls}");
    /// ```
    pub fn current() -> RecordLayer {
        let ulps =
            std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_ulp").unwrap_or_default();
        RecordLayer::UserSpace {
            kernel_offers_ktls: ulps.split_whitespace().any(|u| u == "tls"),
        }
    }
}

impl fmt::Display for RecordLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordLayer::UserSpace {
                kernel_offers_ktls: false,
            } => f.write_str("rustls in user space (the kernel offers no kTLS)"),
            RecordLayer::UserSpace {
                kernel_offers_ktls: true,
            } => f.write_str("rustls in user space (the kernel offers kTLS; not used)"),
        }
    }
}

/// The subject of a (client) certificate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSubject {
    /// The subject as an RFC 4514 string, most specific first (`CN=alice,O=Example`).
    pub distinguished_name: String,
    /// The first common name (`CN`), when the subject has one.
    pub common_name: Option<String>,
}

/// `id-at-commonName` (2.5.4.3).
const COMMON_NAME: ObjectIdentifier = ObjectIdentifier::new_unwrap("2.5.4.3");

impl PeerSubject {
    /// Reads the subject of a DER certificate.
    ///
    /// # Errors
    ///
    /// [`TlsError::PeerCertificate`] if the certificate does not parse.
    pub fn from_certificate(der: &[u8]) -> Result<PeerSubject, TlsError> {
        let cert =
            x509_cert::certificate::CertificateInner::<AnySerial>::from_der(der).map_err(|e| {
                TlsError::PeerCertificate {
                    reason: e.to_string(),
                }
            })?;
        let subject = &cert.tbs_certificate.subject;
        let common_name = subject
            .0
            .iter()
            .flat_map(|rdn| rdn.0.iter())
            .filter(|atv| atv.oid == COMMON_NAME)
            .find_map(|atv| {
                let v = &atv.value;
                match v.tag() {
                    Tag::Utf8String => Utf8StringRef::try_from(v).ok().map(|s| s.to_string()),
                    Tag::PrintableString => {
                        PrintableStringRef::try_from(v).ok().map(|s| s.to_string())
                    }
                    Tag::Ia5String => Ia5StringRef::try_from(v).ok().map(|s| s.to_string()),
                    Tag::TeletexString => TeletexStringRef::try_from(v).ok().map(|s| s.to_string()),
                    _ => None,
                }
            });
        // As `openssl x509 -noout -subject -nameopt RFC2253` prints it (the form the config
        // lists): the attributes from the last to the first, so that the parts of a
        // multi-valued RDN are reversed too (`CN=sensor-7+O=Example`), where RFC 4514 keeps
        // their order.
        let mut distinguished_name = String::new();
        for (i, rdn) in subject.0.iter().rev().enumerate() {
            if i > 0 {
                distinguished_name.push(',');
            }
            for (j, atv) in rdn.0.iter().rev().enumerate() {
                if j > 0 {
                    distinguished_name.push('+');
                }
                distinguished_name.push_str(&atv.to_string());
            }
        }
        Ok(PeerSubject {
            distinguished_name,
            common_name,
        })
    }

    /// The user a client certificate authenticates: its common name, or the whole
    /// distinguished name when it has none.
    pub fn user(&self) -> &str {
        self.common_name
            .as_deref()
            .unwrap_or(&self.distinguished_name)
    }
}

impl fmt::Display for PeerSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.distinguished_name)
    }
}

/// The last moment a DER certificate is valid (its `notAfter`).
///
/// # Errors
///
/// [`TlsError::PeerCertificate`] if the certificate does not parse.
///
/// ```
/// use std::time::{Duration, UNIX_EPOCH};
/// use powerhub::security::tls::certificate_not_after;
///
/// let key = rcgen::KeyPair::generate().unwrap();
/// let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
/// params.not_after = rcgen::date_time_ymd(2030, 1, 1);
/// let cert = params.self_signed(&key).unwrap();
/// let at = certificate_not_after(cert.der()).unwrap();
/// assert_eq!(at, UNIX_EPOCH + Duration::from_secs(1_893_456_000));
/// assert!(certificate_not_after(b"not DER").is_err());
/// ```
pub fn certificate_not_after(der: &[u8]) -> Result<SystemTime, TlsError> {
    // Only the validity is read: the fields before it are skipped whole, so that a field this
    // parser would judge more strictly than the handshake's verification (a serial number
    // longer than RFC 5280's 20 octets, a subject's string types) cannot hide it.
    let read = || -> der::Result<SystemTime> {
        let mut reader = der::SliceReader::new(der)?;
        let at = reader.sequence(|certificate| {
            let at = certificate.sequence(|tbs| {
                let version = Tag::ContextSpecific {
                    constructed: true,
                    number: der::TagNumber::N0,
                };
                if tbs.peek_tag()? == version {
                    tbs.tlv_bytes()?;
                }
                tbs.tlv_bytes()?; // serialNumber
                tbs.tlv_bytes()?; // signature
                tbs.tlv_bytes()?; // issuer
                let validity = x509_cert::time::Validity::decode(tbs)?;
                tbs.read_slice(tbs.remaining_len())?;
                Ok(validity.not_after.to_system_time())
            })?;
            certificate.read_slice(certificate.remaining_len())?;
            Ok(at)
        })?;
        reader.finish(at)
    };
    read().map_err(|e| TlsError::PeerCertificate {
        reason: e.to_string(),
    })
}

/// Reads certificates as the handshake's verification (rustls-webpki) takes them: a serial
/// number of any length. RFC 5280 caps it at 20 octets; CAs that issued longer ones exist, and
/// the verification lets them through, so the subject of such a certificate must read too.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AnySerial;

impl x509_cert::certificate::Profile for AnySerial {
    fn check_serial_number(
        _serial: &x509_cert::serial_number::SerialNumber<Self>,
    ) -> der::Result<()> {
        Ok(())
    }
}

/// What one [`TlsSession::receive`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Received {
    /// Plaintext bytes appended to the caller's buffer.
    pub plaintext: usize,
    /// The peer sent `close_notify`: no more plaintext will come.
    pub peer_closed: bool,
}

/// One server-side TLS connection, sans IO: the shard hands in what it read from the socket and
/// takes out what to write to it; the protocol layer reads and writes plaintext through it.
///
/// Each call does all the work its input allows, and never blocks: after
/// [`TlsSession::receive`] and [`TlsSession::send`], call [`TlsSession::take_ciphertext`] (or
/// check [`TlsSession::wants_write`]) to learn what is to be written.
///
/// A handshake and an NDJSON line each way, in memory, against a rustls client:
///
/// ```
/// use std::io::{Read, Write};
/// use std::sync::Arc;
/// use powerhub::security::tls::{server_config_with, TlsFiles, TlsSession};
///
/// // A self-signed certificate for `localhost`, and the listener's files in memory.
/// let key = rcgen::KeyPair::generate().unwrap();
/// let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
///     .unwrap()
///     .self_signed(&key)
///     .unwrap();
/// let files = TlsFiles { cert: "cert.pem".into(), key: "key.pem".into(), client_ca: None };
/// let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
/// let config = server_config_with(&files, |path| {
///     Ok(if path.ends_with("cert.pem") { cert_pem.clone() } else { key_pem.clone() }.into_bytes())
/// })
/// .unwrap();
///
/// let mut roots = rustls::RootCertStore::empty();
/// roots.add(cert.der().clone()).unwrap();
/// let client_config = rustls::ClientConfig::builder_with_provider(Arc::new(
///     rustls::crypto::ring::default_provider(),
/// ))
/// .with_safe_default_protocol_versions()
/// .unwrap()
/// .with_root_certificates(roots)
/// .with_no_client_auth();
/// let name = "localhost".try_into().unwrap();
/// let mut client = rustls::ClientConnection::new(Arc::new(client_config), name).unwrap();
/// client.writer().write_all(b"{\"type\":\"ping\"}\n").unwrap();
///
/// // What the shard's reads and writes would carry, until both sides are quiet.
/// fn pump(server: &mut TlsSession, client: &mut rustls::ClientConnection, plaintext: &mut Vec<u8>) {
///     loop {
///         let mut from_client = Vec::new();
///         while client.wants_write() {
///             client.write_tls(&mut from_client).unwrap();
///         }
///         server.receive(&from_client, plaintext).unwrap();
///         let mut to_client = Vec::new();
///         server.take_ciphertext(&mut to_client);
///         client.read_tls(&mut &to_client[..]).unwrap();
///         client.process_new_packets().unwrap();
///         if from_client.is_empty() && to_client.is_empty() {
///             return;
///         }
///     }
/// }
///
/// let mut server = TlsSession::new(config).unwrap();
/// let mut plaintext = Vec::new();
/// pump(&mut server, &mut client, &mut plaintext); // the handshake, then the ping
/// assert!(!server.is_handshaking());
/// assert_eq!(plaintext, b"{\"type\":\"ping\"}\n");
///
/// let pong = b"{\"type\":\"pong\"}\n";
/// assert_eq!(server.send(pong), pong.len());
/// pump(&mut server, &mut client, &mut plaintext);
/// let mut reply = [0u8; 16];
/// client.reader().read_exact(&mut reply).unwrap();
/// assert_eq!(&reply, pong);
/// ```
pub struct TlsSession {
    conn: ServerConnection,
}

impl fmt::Debug for TlsSession {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsSession")
            .field("handshaking", &self.conn.is_handshaking())
            .field("protocol_version", &self.conn.protocol_version())
            .finish()
    }
}

impl TlsSession {
    /// A connection that has not yet received a byte.
    ///
    /// # Errors
    ///
    /// What rustls refuses in `config` (it does not refuse a config built by
    /// [`server_config`]).
    pub fn new(config: Arc<ServerConfig>) -> Result<TlsSession, TlsSessionError> {
        Ok(TlsSession {
            conn: ServerConnection::new(config)?,
        })
    }

    /// Feeds bytes received from the socket and appends the plaintext they complete to
    /// `plaintext`. Takes all of `ciphertext` (what rustls cannot act on yet, a partial record,
    /// it keeps for the next call).
    ///
    /// # Errors
    ///
    /// The peer broke the protocol or failed the handshake; the connection is over (send the
    /// alert: [`TlsSession::take_ciphertext`]).
    pub fn receive(
        &mut self,
        mut ciphertext: &[u8],
        plaintext: &mut Vec<u8>,
    ) -> Result<Received, TlsSessionError> {
        let mut out = Received::default();
        while !ciphertext.is_empty() {
            let n = self
                .conn
                .read_tls(&mut ciphertext)
                .map_err(TlsSessionError::Buffer)?;
            let state = self.conn.process_new_packets()?;
            // Drained after every record batch, so rustls's plaintext buffer never fills.
            let ready = state.plaintext_bytes_to_read();
            if ready > 0 {
                let start = plaintext.len();
                plaintext.resize(start + ready, 0);
                // Read a piece at a time: rustls copies what each read asks for at once.
                for piece in plaintext[start..].chunks_mut(copy::PIECE) {
                    self.conn
                        .reader()
                        .read_exact(piece)
                        .map_err(TlsSessionError::Buffer)?;
                }
                out.plaintext += ready;
            }
            if state.peer_has_closed() {
                out.peer_closed = true;
            }
            if n == 0 {
                break;
            }
        }
        Ok(out)
    }

    /// Encrypts `data` for the peer (held back until the handshake completes). Returns how much
    /// of it rustls took: less than all once its buffer limit (64 KiB unless changed through
    /// [`TlsSession::connection_mut`]) is reached; take the ciphertext, write it, and offer the
    /// rest again.
    pub fn send(&mut self, data: &[u8]) -> usize {
        // Writing to rustls's buffer fails only when it is full, which is the `0` taken.
        self.conn.writer().write(data).unwrap_or(0)
    }

    /// [`TlsSession::send`] of the concatenation of `parts`, cut into as few records as rustls
    /// allows (up to 16 KiB of plaintext each) however small the parts are: one record per
    /// part would cost an encryption and 22 bytes each. Returns how much rustls took.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # fn demo(config: Arc<rustls::ServerConfig>) -> Result<(), Box<dyn std::error::Error>> {
    /// use powerhub::security::tls::TlsSession;
    ///
    /// let mut tls = TlsSession::new(config)?;
    /// let lines: [&[u8]; 3] = [b"{\"n\":1}\n", b"{\"n\":2}\n", b"{\"n\":3}\n"];
    /// let taken = tls.send_vectored(&lines);
    /// assert!(taken <= 24);
    /// # Ok(()) }
    /// ```
    pub fn send_vectored(&mut self, parts: &[impl AsRef<[u8]>]) -> usize {
        // Offered in pieces of at most `copy::PIECE` bytes, which rustls copies into its records
        // one at a time (a larger copy may take glibc's slow `rep movsb`: see `crate::copy`),
        // and one full record at a time, since rustls walks every piece of an offer for each
        // record it cuts from it.
        let mut taken = 0;
        let mut offer: Vec<io::IoSlice<'_>> = Vec::with_capacity(RECORD / copy::PIECE + 2);
        let mut room = RECORD;
        for part in parts {
            let mut rest = part.as_ref();
            while !rest.is_empty() {
                let (piece, after) = rest.split_at(rest.len().min(copy::PIECE).min(room));
                offer.push(io::IoSlice::new(piece));
                rest = after;
                room -= piece.len();
                if room == 0 {
                    let took = self.conn.writer().write_vectored(&offer).unwrap_or(0);
                    taken += took;
                    if took < RECORD {
                        return taken;
                    }
                    offer.clear();
                    room = RECORD;
                }
            }
        }
        if !offer.is_empty() {
            taken += self.conn.writer().write_vectored(&offer).unwrap_or(0);
        }
        taken
    }

    /// Appends everything rustls has to send (handshake messages, records, alerts) to `out`;
    /// returns how many bytes.
    pub fn take_ciphertext(&mut self, out: &mut Vec<u8>) -> usize {
        let start = out.len();
        while self.conn.wants_write() {
            // Writing to a Vec does not fail.
            if self.conn.write_tls(&mut copy::Pieces(out)).unwrap_or(0) == 0 {
                break;
            }
        }
        out.len() - start
    }

    /// Whether rustls has bytes to send.
    pub fn wants_write(&self) -> bool {
        self.conn.wants_write()
    }

    /// Whether the handshake is still under way.
    pub fn is_handshaking(&self) -> bool {
        self.conn.is_handshaking()
    }

    /// Queues `close_notify` (take the ciphertext to send it).
    pub fn close(&mut self) {
        self.conn.send_close_notify();
    }

    /// The negotiated protocol version, once the handshake has got that far.
    pub fn protocol_version(&self) -> Option<ProtocolVersion> {
        self.conn.protocol_version()
    }

    /// The subject of the client's certificate (mutual TLS, once the handshake completed);
    /// `None` when the client presented none.
    pub fn peer_subject(&self) -> Option<Result<PeerSubject, TlsError>> {
        let chain = self.conn.peer_certificates()?;
        chain
            .first()
            .map(|end_entity| PeerSubject::from_certificate(end_entity))
    }

    /// When the client's certificate chain stops being valid: the earliest `notAfter` of the
    /// certificates it presented (mutual TLS, once the handshake completed; validity is
    /// inclusive, so the chain is expired from one second past it). `None` when the client
    /// presented none.
    ///
    /// The end-entity certificate's validity was read by the handshake's verification; should
    /// it not read here, the chain counts as expired (at the epoch), so that a certificate this
    /// reading misses never lives for ever. A further certificate bounds nothing where the
    /// verification cannot have taken it into the path it verified: one that does not read (it
    /// reads each it takes), and, after a full handshake completed at `now`, one already past
    /// its `notAfter` (it skips an expired candidate, as a cross-signed bundle's old
    /// intermediate). A resumed session (which a mutual-TLS [`server_config`] never grants) was
    /// not verified again: each certificate that reads counts, expired or not.
    pub fn peer_valid_until(&self, now: SystemTime) -> Option<SystemTime> {
        let (end_entity, rest) = self.conn.peer_certificates()?.split_first()?;
        let mut earliest = certificate_not_after(end_entity).unwrap_or(UNIX_EPOCH);
        let verified_now = !matches!(
            self.conn.handshake_kind(),
            Some(rustls::HandshakeKind::Resumed)
        );
        let secs = |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        for der in rest {
            let Ok(at) = certificate_not_after(der) else {
                continue;
            };
            if verified_now && secs(now) > secs(at) {
                continue;
            }
            earliest = earliest.min(at);
        }
        Some(earliest)
    }

    /// The rustls connection, to read what this wrapper does not (SNI, ALPN).
    pub fn connection(&self) -> &ServerConnection {
        &self.conn
    }

    /// The rustls connection, to change what this wrapper does not (its buffer limit).
    pub fn connection_mut(&mut self) -> &mut ServerConnection {
        &mut self.conn
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    use rustls::pki_types::ServerName;
    use rustls::{ClientConfig, ClientConnection};

    /// A CA, a server certificate for `localhost` and a client certificate for `alice`, all
    /// made here.
    pub(crate) struct Pki {
        ca_pem: String,
        server_cert_pem: String,
        server_key_pem: String,
        client_cert_der: CertificateDer<'static>,
        client_key_der: Vec<u8>,
        ca_der: CertificateDer<'static>,
        ca: rcgen::Certificate,
        ca_key: KeyPair,
    }

    pub(crate) fn pki() -> Pki {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.distinguished_name = DistinguishedName::new();
        ca.distinguished_name
            .push(DnType::CommonName, "powerhub test CA");
        let ca = ca.self_signed(&ca_key).unwrap();

        let server_key = KeyPair::generate().unwrap();
        let mut server = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = server.signed_by(&server_key, &ca, &ca_key).unwrap();

        let client_key = KeyPair::generate().unwrap();
        let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
        client.distinguished_name = DistinguishedName::new();
        client.distinguished_name.push(DnType::CommonName, "alice");
        client
            .distinguished_name
            .push(DnType::OrganizationName, "Example, Inc.");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = client.signed_by(&client_key, &ca, &ca_key).unwrap();

        Pki {
            ca_pem: ca.pem(),
            ca_der: ca.der().clone(),
            server_cert_pem: server.pem(),
            server_key_pem: server_key.serialize_pem(),
            client_cert_der: client.der().clone(),
            client_key_der: client_key.serialize_der(),
            ca,
            ca_key,
        }
    }

    pub(crate) fn files(client_ca: bool) -> TlsFiles {
        TlsFiles {
            cert: "server.pem".into(),
            key: "server.key".into(),
            client_ca: client_ca.then(|| "ca.pem".into()),
        }
    }

    pub(crate) fn reader(pki: &Pki) -> impl FnMut(&Path) -> io::Result<Vec<u8>> + '_ {
        move |p| {
            let text = match p.to_str() {
                Some("server.pem") => &pki.server_cert_pem,
                Some("server.key") => &pki.server_key_pem,
                Some("ca.pem") => &pki.ca_pem,
                _ => return Err(io::ErrorKind::NotFound.into()),
            };
            Ok(text.as_bytes().to_vec())
        }
    }

    pub(crate) fn client_config(
        pki: &Pki,
        with_cert: bool,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(pki.ca_der.clone()).unwrap();
        let builder = ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(versions)
            .unwrap()
            .with_root_certificates(roots);
        let config = if with_cert {
            let key = PrivateKeyDer::try_from(pki.client_key_der.clone()).unwrap();
            builder
                .with_client_auth_cert(vec![pki.client_cert_der.clone()], key)
                .unwrap()
        } else {
            builder.with_no_client_auth()
        };
        Arc::new(config)
    }

    /// Moves bytes both ways until neither side has anything to say. Returns the server's
    /// plaintext and its first error.
    pub(crate) fn pump(
        client: &mut ClientConnection,
        server: &mut TlsSession,
        server_plaintext: &mut Vec<u8>,
    ) -> Result<(), TlsSessionError> {
        for _ in 0..20 {
            let mut c2s = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut c2s).unwrap();
            }
            let result = server.receive(&c2s, server_plaintext);
            let mut s2c = Vec::new();
            server.take_ciphertext(&mut s2c);
            if !s2c.is_empty() {
                let mut rd = &s2c[..];
                while !rd.is_empty() {
                    client.read_tls(&mut rd).unwrap();
                }
                // The client may fail too (it reads the server's alert); the server's error is
                // the one under test.
                let _ = client.process_new_packets();
            }
            result?;
            if c2s.is_empty() && s2c.is_empty() {
                return Ok(());
            }
        }
        panic!("the connections never went quiet");
    }

    fn client_plaintext(client: &mut ClientConnection) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match client.reader().read(&mut buf) {
                Ok(0) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        out
    }

    /// A full handshake in memory, then an NDJSON line each way.
    fn exchange(server_config: Arc<ServerConfig>, client_config: Arc<ClientConfig>) -> TlsSession {
        let mut server = TlsSession::new(server_config).unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut client = ClientConnection::new(client_config, name).unwrap();
        let mut plaintext = Vec::new();

        // The server's greeting, written before the handshake: held back, not lost.
        let hello = b"{\"type\":\"hello\"}\n";
        assert_eq!(server.send(hello), hello.len());
        pump(&mut client, &mut server, &mut plaintext).unwrap();
        assert!(!server.is_handshaking());
        assert!(!client.is_handshaking());

        let ping = b"{\"type\":\"ping\",\"id\":1}\n";
        client.writer().write_all(ping).unwrap();
        pump(&mut client, &mut server, &mut plaintext).unwrap();
        assert_eq!(plaintext, ping);

        let pong = b"{\"type\":\"pong\",\"requestId\":1}\n";
        assert_eq!(server.send(pong), pong.len());
        pump(&mut client, &mut server, &mut plaintext).unwrap();
        let mut expected = hello.to_vec();
        expected.extend_from_slice(pong);
        assert_eq!(client_plaintext(&mut client), expected);

        // The client says goodbye.
        client.send_close_notify();
        let mut c2s = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut c2s).unwrap();
        }
        let got = server.receive(&c2s, &mut plaintext).unwrap();
        assert!(got.peer_closed);
        server
    }

    #[test]
    fn handshake_and_ndjson_both_ways_over_tls13() {
        let pki = pki();
        let config = server_config_with(&files(false), reader(&pki)).unwrap();
        let client = client_config(&pki, false, &[&rustls::version::TLS13]);
        let server = exchange(config, client);
        assert_eq!(server.protocol_version(), Some(ProtocolVersion::TLSv1_3));
        assert!(server.peer_subject().is_none());
    }

    /// Parts of any size, sent in copy pieces and offered a record at a time, arrive whole and
    /// in order, in full records; a large receive is read out whole.
    #[test]
    fn parts_of_any_size_go_out_in_full_records_and_come_in_whole() {
        let pki = pki();
        let config = server_config_with(&files(false), reader(&pki)).unwrap();
        for versions in [&rustls::version::TLS13, &rustls::version::TLS12] {
            let mut server = TlsSession::new(Arc::clone(&config)).unwrap();
            server.connection_mut().set_buffer_limit(None);
            let name = ServerName::try_from("localhost").unwrap();
            let mut client =
                ClientConnection::new(client_config(&pki, false, &[versions]), name).unwrap();
            let mut plaintext = Vec::new();
            pump(&mut client, &mut server, &mut plaintext).unwrap();
            let sizes = [1usize, 2047, 2049, 16383, 16385, 40_000, 7, 0, 3 * RECORD];
            let parts: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(k, &n)| (0..n).map(|i| (i * 7 + k) as u8).collect())
                .collect();
            let total: usize = sizes.iter().sum();
            assert_eq!(server.send_vectored(&parts), total);
            let mut s2c = Vec::new();
            server.take_ciphertext(&mut s2c);
            // Application data records: as few as 16 KiB of plaintext each allows.
            let mut records = 0;
            let mut at = 0;
            while at < s2c.len() {
                let len = usize::from(u16::from_be_bytes([s2c[at + 3], s2c[at + 4]]));
                records += usize::from(s2c[at] == 23);
                at += 5 + len;
            }
            assert_eq!(records, total.div_ceil(RECORD), "{versions:?}");
            let mut rd = &s2c[..];
            let mut got = Vec::new();
            while !rd.is_empty() {
                client.read_tls(&mut rd).unwrap();
                client.process_new_packets().unwrap();
                got.extend(client_plaintext(&mut client));
            }
            assert_eq!(got, parts.concat(), "{versions:?}");

            // The other way: records of 16 KiB, read out a piece at a time.
            let big: Vec<u8> = (0..5 * RECORD + 5).map(|i| (i % 253) as u8).collect();
            client.set_buffer_limit(None);
            client.writer().write_all(&big).unwrap();
            pump(&mut client, &mut server, &mut plaintext).unwrap();
            assert_eq!(plaintext, big, "{versions:?}");
        }
    }

    #[test]
    fn handshake_and_ndjson_both_ways_over_tls12() {
        let pki = pki();
        let config = server_config_with(&files(false), reader(&pki)).unwrap();
        let client = client_config(&pki, false, &[&rustls::version::TLS12]);
        let server = exchange(config, client);
        assert_eq!(server.protocol_version(), Some(ProtocolVersion::TLSv1_2));
    }

    #[test]
    fn mutual_tls_gives_the_client_certificates_subject_as_the_user() {
        let pki = pki();
        let config = server_config_with(&files(true), reader(&pki)).unwrap();
        for versions in [&rustls::version::TLS13, &rustls::version::TLS12] {
            let client = client_config(&pki, true, &[versions]);
            let server = exchange(Arc::clone(&config), client);
            let subject = server.peer_subject().unwrap().unwrap();
            assert_eq!(subject.common_name.as_deref(), Some("alice"));
            assert_eq!(subject.user(), "alice");
            assert_eq!(subject.distinguished_name, "O=Example\\, Inc.,CN=alice");
        }
    }

    /// The chain's validity is the earliest `notAfter` of the certificates the verification may
    /// have taken: an intermediate expiring before the end-entity certificate bounds it, and
    /// an extra certificate already expired at the full handshake (a cross-signed bundle's old
    /// intermediate, which the verification skips) does not. A `notAfter` from 2050 on, a
    /// GeneralizedTime, reads as well.
    #[test]
    fn the_chains_validity_is_the_earliest_not_after_the_verification_may_have_taken() {
        let pki = pki();
        let config = server_config_with(&files(true), reader(&pki)).unwrap();
        let at = |y| rcgen::date_time_ymd(y, 1, 1);
        let unix = |y| std::time::SystemTime::from(at(y));
        let ca_params = |not_after| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p.key_usages = vec![KeyUsagePurpose::KeyCertSign];
            p.distinguished_name = DistinguishedName::new();
            p.distinguished_name
                .push(DnType::CommonName, "powerhub test intermediate");
            p.not_after = not_after;
            p
        };
        let leaf_params = |not_after| {
            let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
            p.distinguished_name = DistinguishedName::new();
            p.distinguished_name.push(DnType::CommonName, "alice");
            p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
            p.not_after = not_after;
            p
        };
        let inter_key = KeyPair::generate().unwrap();
        let inter = ca_params(at(2039))
            .signed_by(&inter_key, &pki.ca, &pki.ca_key)
            .unwrap();
        let old_key = KeyPair::generate().unwrap();
        let mut old = ca_params(at(2021));
        old.not_before = at(2020);
        let old = old.signed_by(&old_key, &pki.ca, &pki.ca_key).unwrap();
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = leaf_params(at(2040))
            .signed_by(&leaf_key, &inter, &inter_key)
            .unwrap();
        let late_key = KeyPair::generate().unwrap();
        let late = leaf_params(at(2051))
            .signed_by(&late_key, &pki.ca, &pki.ca_key)
            .unwrap();
        let cases = [
            (
                vec![leaf.der().clone(), inter.der().clone()],
                &leaf_key,
                2039,
            ),
            (
                vec![leaf.der().clone(), inter.der().clone(), old.der().clone()],
                &leaf_key,
                2039,
            ),
            (vec![late.der().clone()], &late_key, 2051),
        ];
        for (chain, key, until) in cases {
            let mut roots = RootCertStore::empty();
            roots.add(pki.ca_der.clone()).unwrap();
            let client = ClientConfig::builder_with_provider(provider())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, PrivateKeyDer::try_from(key.serialize_der()).unwrap())
                .unwrap();
            let server = exchange(Arc::clone(&config), Arc::new(client));
            assert_eq!(
                server.connection().handshake_kind(),
                Some(rustls::HandshakeKind::Full)
            );
            let now = SystemTime::now();
            assert_eq!(server.peer_valid_until(now), Some(unix(until)), "{until}");
        }
        assert_eq!(certificate_not_after(old.der()).unwrap(), unix(2021));
    }

    /// A mutual-TLS listener resumes no session (every chain is verified in full at its own
    /// connection), while a listener without client certificates resumes as rustls does.
    #[test]
    fn mutual_tls_resumes_no_session() {
        let pki = pki();
        for (client_ca, expected) in [
            (true, rustls::HandshakeKind::Full),
            (false, rustls::HandshakeKind::Resumed),
        ] {
            let config = server_config_with(&files(client_ca), reader(&pki)).unwrap();
            for versions in [&rustls::version::TLS13, &rustls::version::TLS12] {
                // One client config: its session cache carries what the first connection got.
                let client = client_config(&pki, client_ca, &[versions]);
                let first = exchange(Arc::clone(&config), Arc::clone(&client));
                assert_eq!(
                    first.connection().handshake_kind(),
                    Some(rustls::HandshakeKind::Full)
                );
                let second = exchange(Arc::clone(&config), client);
                assert_eq!(
                    second.connection().handshake_kind(),
                    Some(expected),
                    "client_ca {client_ca}, {versions:?}"
                );
            }
        }
    }

    #[test]
    fn mutual_tls_refuses_a_client_without_a_certificate() {
        let pki = pki();
        let config = server_config_with(&files(true), reader(&pki)).unwrap();
        let mut server = TlsSession::new(config).unwrap();
        let client_cfg = client_config(&pki, false, &[&rustls::version::TLS13]);
        let name = ServerName::try_from("localhost").unwrap();
        let mut client = ClientConnection::new(client_cfg, name).unwrap();
        let mut plaintext = Vec::new();
        let mut refused = None;
        for _ in 0..10 {
            let mut c2s = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut c2s).unwrap();
            }
            let result = server.receive(&c2s, &mut plaintext);
            // Whether it failed or not, what the server queued (its alert, too) goes out.
            let mut s2c = Vec::new();
            server.take_ciphertext(&mut s2c);
            client.read_tls(&mut &s2c[..]).unwrap();
            let client_result = client.process_new_packets();
            if let Err(e) = result {
                refused = Some((e, client_result));
                break;
            }
        }
        let (err, client_result) = refused.expect("the server refuses the handshake");
        assert_eq!(err.code(), "tls_certificate", "{err}");
        // The client learns why from the alert.
        assert!(
            matches!(
                client_result,
                Err(rustls::Error::AlertReceived(
                    rustls::AlertDescription::CertificateRequired
                ))
            ),
            "{client_result:?}"
        );
        assert!(plaintext.is_empty());
    }

    #[test]
    fn mutual_tls_refuses_a_certificate_from_another_ca() {
        let pki_a = pki();
        let pki_b = pki();
        let config = server_config_with(&files(true), reader(&pki_a)).unwrap();
        let mut server = TlsSession::new(config).unwrap();
        // Trusts server A's CA but presents B's client certificate.
        let mut roots = RootCertStore::empty();
        roots.add(pki_a.ca_der.clone()).unwrap();
        let key = PrivateKeyDer::try_from(pki_b.client_key_der.clone()).unwrap();
        let client_cfg = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(vec![pki_b.client_cert_der.clone()], key)
            .unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut client = ClientConnection::new(Arc::new(client_cfg), name).unwrap();
        let err = pump(&mut client, &mut server, &mut Vec::new()).unwrap_err();
        assert_eq!(err.code(), "tls_certificate", "{err}");
    }

    #[test]
    fn a_session_can_move_to_its_shard() {
        fn movable<T: Send>() {}
        movable::<TlsSession>();
        fn shared<T: Send + Sync>() {}
        shared::<ServerConfig>();
    }

    #[test]
    fn garbage_from_the_peer_is_an_error_not_a_panic() {
        let pki = pki();
        let config = server_config_with(&files(false), reader(&pki)).unwrap();
        let mut server = TlsSession::new(config).unwrap();
        let err = server
            .receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", &mut Vec::new())
            .unwrap_err();
        assert!(matches!(err, TlsSessionError::Protocol(_)), "{err:?}");
    }

    /// A server session and a client that completed a TLS 1.3 handshake in memory.
    fn handshaken() -> (TlsSession, ClientConnection) {
        let pki = pki();
        let config = server_config_with(&files(false), reader(&pki)).unwrap();
        let mut server = TlsSession::new(config).unwrap();
        let name = ServerName::try_from("localhost").unwrap();
        let mut client =
            ClientConnection::new(client_config(&pki, false, &[&rustls::version::TLS13]), name)
                .unwrap();
        pump(&mut client, &mut server, &mut Vec::new()).unwrap();
        (server, client)
    }

    #[test]
    fn large_writes_are_taken_in_part_and_all_arrive() {
        let (mut server, mut client) = handshaken();
        let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let mut offset = 0;
        let mut received = Vec::new();
        while offset < big.len() {
            let n = server.send(&big[offset..]);
            offset += n;
            let mut s2c = Vec::new();
            server.take_ciphertext(&mut s2c);
            let mut rd = &s2c[..];
            while !rd.is_empty() {
                client.read_tls(&mut rd).unwrap();
                client.process_new_packets().unwrap();
                received.extend(client_plaintext(&mut client));
            }
        }
        assert_eq!(received, big);

        // And the other way: 300 KB from the client handed over in one receive.
        client.set_buffer_limit(None);
        client.writer().write_all(&big).unwrap();
        let mut c2s = Vec::new();
        while client.wants_write() {
            client.write_tls(&mut c2s).unwrap();
        }
        let mut plaintext = Vec::new();
        let got = server.receive(&c2s, &mut plaintext).unwrap();
        assert_eq!(got.plaintext, big.len());
        assert_eq!(plaintext, big);
    }

    #[test]
    fn small_parts_sent_together_share_records_and_arrive_in_order() {
        let (mut server, mut client) = handshaken();
        let lines: Vec<Vec<u8>> = (0..200)
            .map(|i| format!("{{\"n\":{i},\"pad\":\"{}\"}}\n", "x".repeat(100)).into_bytes())
            .collect();
        let total: usize = lines.iter().map(Vec::len).sum();
        assert_eq!(server.send_vectored(&lines), total);
        let mut s2c = Vec::new();
        server.take_ciphertext(&mut s2c);
        // Application-data records (type 23): as many as 16 KiB records need, not one per line.
        let mut records = 0;
        let mut at = 0;
        while at + 5 <= s2c.len() {
            records += usize::from(s2c[at] == 23);
            at += 5 + usize::from(u16::from_be_bytes([s2c[at + 3], s2c[at + 4]]));
        }
        assert!(
            records <= total.div_ceil(16 << 10) + 1,
            "{records} records for {total} bytes"
        );
        let mut rd = &s2c[..];
        let mut received = Vec::new();
        while !rd.is_empty() {
            client.read_tls(&mut rd).unwrap();
            client.process_new_packets().unwrap();
            received.extend(client_plaintext(&mut client));
        }
        assert_eq!(received, lines.concat());
    }

    #[test]
    fn configuration_errors_name_the_file_and_the_problem() {
        let pki = pki();
        let other_key = KeyPair::generate().unwrap().serialize_pem();
        let build = |cert: &str, key: &str, ca: Option<&str>| {
            let files = TlsFiles {
                cert: "c.pem".into(),
                key: "k.pem".into(),
                client_ca: ca.map(|_| "ca.pem".into()),
            };
            let (cert, key, ca) = (cert.to_owned(), key.to_owned(), ca.map(str::to_owned));
            server_config_with(&files, move |p| match p.to_str() {
                Some("c.pem") => Ok(cert.clone().into_bytes()),
                Some("k.pem") => Ok(key.clone().into_bytes()),
                Some("ca.pem") => Ok(ca.clone().unwrap().into_bytes()),
                _ => Err(io::ErrorKind::NotFound.into()),
            })
            .unwrap_err()
        };
        let err = build(&pki.server_key_pem, &pki.server_key_pem, None);
        assert!(
            matches!(
                &err,
                TlsError::NoCertificate {
                    key: "tls_cert",
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "tls_cert c.pem: no CERTIFICATE in the file"
        );
        let err = build(&pki.server_cert_pem, &pki.server_cert_pem, None);
        assert!(matches!(err, TlsError::NoPrivateKey { .. }), "{err}");
        // An encrypted PKCS#8 key (its body need not be real: the label decides).
        let encrypted = "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIBvTBXBgkqhkiG9w0BBQ0wSjApBgkqhkiG9w0BBQwwHAQI\n-----END ENCRYPTED PRIVATE KEY-----\n";
        let err = build(&pki.server_cert_pem, encrypted, None);
        assert!(matches!(err, TlsError::EncryptedPrivateKey { .. }), "{err}");
        assert!(err.to_string().contains("encrypted"), "{err}");
        // The legacy PEM encryption (`openssl rsa -aes256 -traditional`).
        let legacy = "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-256-CBC,0123456789ABCDEF0123456789ABCDEF\n\nMIIBvTBXBgkqhkiG9w0BBQ0wSjApBgkqhkiG9w0BBQwwHAQI\n-----END RSA PRIVATE KEY-----\n";
        let err = build(&pki.server_cert_pem, legacy, None);
        assert!(matches!(err, TlsError::EncryptedPrivateKey { .. }), "{err}");
        let err = build(&pki.server_cert_pem, &other_key, None);
        assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
        assert!(err.to_string().contains("k.pem") && err.to_string().contains("c.pem"));
        let truncated = &pki.server_cert_pem[..pki.server_cert_pem.len() - 30];
        let err = build(truncated, &pki.server_key_pem, None);
        assert!(
            matches!(
                err,
                TlsError::Pem {
                    key: "tls_cert",
                    ..
                }
            ),
            "{err}"
        );
        let err = build(
            &pki.server_cert_pem,
            &pki.server_key_pem,
            Some("nothing here"),
        );
        assert!(
            matches!(
                err,
                TlsError::NoCertificate {
                    key: "tls_client_ca",
                    ..
                }
            ),
            "{err}"
        );
        let junk = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
        let err = build(&pki.server_cert_pem, &pki.server_key_pem, Some(junk));
        assert!(
            matches!(
                err,
                TlsError::BadCertificate {
                    key: "tls_client_ca",
                    ..
                }
            ),
            "{err}"
        );
        let err =
            server_config_with(&files(false), |_| Err(io::ErrorKind::NotFound.into())).unwrap_err();
        assert!(
            matches!(
                &err,
                TlsError::Read {
                    key: "tls_cert",
                    ..
                }
            ),
            "{err}"
        );
        assert!(err
            .to_string()
            .starts_with("tls_cert server.pem: cannot read"));
        assert!(matches!(
            TlsFiles::from_listener_keys(None, None, Some(Path::new("ca.pem"))),
            Err(TlsError::Incomplete {
                given: "tls_client_ca",
                ..
            })
        ));
    }

    #[test]
    fn server_config_reads_real_files() {
        let pki = pki();
        let dir = std::env::temp_dir().join(format!("powerhub-tls-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = dir.join("cert.pem");
        let key = dir.join("key.pem");
        std::fs::write(&cert, &pki.server_cert_pem).unwrap();
        std::fs::write(&key, &pki.server_key_pem).unwrap();
        let files = TlsFiles::from_listener_keys(Some(&cert), Some(&key), None)
            .unwrap()
            .unwrap();
        let result = server_config(&files);
        std::fs::remove_dir_all(&dir).unwrap();
        result.unwrap();
    }

    #[test]
    fn subject_without_common_name_is_the_whole_name() {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::OrganizationName, "Devices");
        params
            .distinguished_name
            .push(DnType::OrganizationalUnitName, "sensor-7");
        let cert = params.self_signed(&key).unwrap();
        let s = PeerSubject::from_certificate(cert.der()).unwrap();
        assert_eq!(s.common_name, None);
        assert_eq!(s.user(), "OU=sensor-7,O=Devices");
        assert!(PeerSubject::from_certificate(b"not der").is_err());
    }

    /// A serial number longer than RFC 5280's 20 octets, which the handshake's verification
    /// accepts, hides neither the subject nor the validity; a version 1 certificate (no
    /// version field) reads too, and what is no certificate does not.
    #[test]
    fn a_long_serial_number_hides_neither_the_subject_nor_the_not_after() {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, "alice");
        params.serial_number = Some(rcgen::SerialNumber::from_slice(&[0x7f; 30]));
        params.not_after = rcgen::date_time_ymd(2031, 1, 1);
        let cert = params.self_signed(&key).unwrap();
        assert!(
            x509_cert::Certificate::from_der(cert.der()).is_err(),
            "strict"
        );
        let subject = PeerSubject::from_certificate(cert.der()).unwrap();
        assert_eq!(subject.distinguished_name, "CN=alice");
        let at = certificate_not_after(cert.der()).unwrap();
        assert_eq!(
            at,
            UNIX_EPOCH + std::time::Duration::from_secs(1_924_992_000)
        );

        // Version 1: the TBS starts at its serial number.
        let v1 = strip_version(cert.der());
        assert_eq!(certificate_not_after(&v1).unwrap(), at);

        for junk in [&b"not der"[..], &[0x30, 0x03, 1, 2, 3], &[]] {
            assert!(certificate_not_after(junk).is_err(), "{junk:?}");
        }
        // Trailing bytes after the certificate are refused.
        let mut trailing = cert.der().to_vec();
        trailing.push(0);
        assert!(certificate_not_after(&trailing).is_err());
    }

    /// `der` (a certificate) with its TBS's `[0]` version field taken out and the lengths
    /// around it mended.
    fn strip_version(der: &[u8]) -> Vec<u8> {
        // A SEQUENCE's header: its length, and where its content starts.
        let header = |at: usize| -> (usize, usize) {
            assert_eq!(der[at], 0x30);
            match der[at + 1] {
                n if n < 0x80 => (usize::from(n), at + 2),
                0x81 => (usize::from(der[at + 2]), at + 3),
                0x82 => (
                    usize::from(der[at + 2]) << 8 | usize::from(der[at + 3]),
                    at + 4,
                ),
                other => panic!("length form {other:#x}"),
            }
        };
        let encode = |len: usize, out: &mut Vec<u8>| {
            out.push(0x30);
            match len {
                0..=0x7f => out.push(len as u8),
                0x80..=0xff => out.extend_from_slice(&[0x81, len as u8]),
                _ => out.extend_from_slice(&[0x82, (len >> 8) as u8, len as u8]),
            }
        };
        let (_, tbs_at) = header(0);
        let (tbs_len, version_at) = header(tbs_at);
        let version = [0xa0, 0x03, 0x02, 0x01, 0x02];
        assert_eq!(&der[version_at..version_at + 5], &version);
        let mut tbs = Vec::new();
        encode(tbs_len - 5, &mut tbs);
        tbs.extend_from_slice(&der[version_at + 5..version_at + tbs_len]);
        let rest = &der[version_at + tbs_len..];
        let mut out = Vec::new();
        encode(tbs.len() + rest.len(), &mut out);
        out.extend_from_slice(&tbs);
        out.extend_from_slice(rest);
        out
    }
}
