//! TLS on the engine's listeners, on real loopback sockets and both backends, with rustls as
//! the client: the push protocol over TLS 1.3 and 1.2 (NDJSON and WebSocket), large and many
//! messages through the record layer, mutual TLS, plaintext to a TLS port and TLS to a plaintext
//! port, configuration errors naming the key and file, and a reload of the certificates.

mod engine_support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;

use engine_support::*;
use powerhub::runtime::{BackendChoice, Config, Engine, ListenerConfig, ProtocolRegistry};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use serde_json::{json, Value};

/// A CA, a server certificate for `localhost` and `127.0.0.1` and a client certificate, written
/// to a directory of their own.
struct Pki {
    dir: PathBuf,
    ca: CertificateDer<'static>,
    ca_cert: rcgen::Certificate,
    ca_key: KeyPair,
    client_cert: CertificateDer<'static>,
    client_key: Vec<u8>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("powerhub-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        ca.distinguished_name = DistinguishedName::new();
        ca.distinguished_name
            .push(DnType::CommonName, format!("powerhub test CA {name}"));
        let ca = ca.self_signed(&ca_key).unwrap();
        let server_key = KeyPair::generate().unwrap();
        let mut server =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let server = server.signed_by(&server_key, &ca, &ca_key).unwrap();
        let client_key = KeyPair::generate().unwrap();
        let mut client = CertificateParams::new(Vec::<String>::new()).unwrap();
        client.distinguished_name = DistinguishedName::new();
        client.distinguished_name.push(DnType::CommonName, "alice");
        client.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let client = client.signed_by(&client_key, &ca, &ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        std::fs::write(dir.join("server.pem"), server.pem()).unwrap();
        std::fs::write(dir.join("server.key"), server_key.serialize_pem()).unwrap();
        Pki {
            dir,
            ca: ca.der().clone(),
            ca_cert: ca,
            ca_key,
            client_cert: client.der().clone(),
            client_key: client_key.serialize_der(),
        }
    }

    /// A client config presenting a fresh certificate of the CA for `CN=alice` whose last
    /// valid second (`notAfter`) is `secs` from now, and that moment in Unix seconds. `odd`:
    /// with a serial number of 30 octets (past RFC 5280's 20, which the verification takes),
    /// and followed in the chain by bytes that are no certificate (which it never reads).
    fn client_expiring(&self, secs: u64, odd: bool) -> (Arc<ClientConfig>, u64) {
        let not_after = unix_now() + secs;
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, "alice");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.not_after =
            rcgen::date_time_ymd(1970, 1, 1) + std::time::Duration::from_secs(not_after);
        if odd {
            params.serial_number = Some(rcgen::SerialNumber::from_slice(&[0x7f; 30]));
        }
        let cert = params.signed_by(&key, &self.ca_cert, &self.ca_key).unwrap();
        let mut chain = vec![cert.der().clone()];
        if odd {
            chain.push(CertificateDer::from(vec![0x30, 0x03, 1, 2, 3]));
        }
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).unwrap();
        let config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, PrivateKeyDer::try_from(key.serialize_der()).unwrap())
                .unwrap();
        (Arc::new(config), not_after)
    }

    fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    fn client(
        &self,
        with_cert: bool,
        versions: &[&'static rustls::SupportedProtocolVersion],
    ) -> Arc<ClientConfig> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone()).unwrap();
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_protocol_versions(versions)
                .unwrap()
                .with_root_certificates(roots);
        Arc::new(if with_cert {
            let key = PrivateKeyDer::try_from(self.client_key.clone()).unwrap();
            builder
                .with_client_auth_cert(vec![self.client_cert.clone()], key)
                .unwrap()
        } else {
            builder.with_no_client_auth()
        })
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tls_listener(protocol: &str, pki: &Pki) -> ListenerConfig {
    ListenerConfig::tcp(protocol, "127.0.0.1:0")
        .with_tls(pki.path("server.pem"), pki.path("server.key"))
}

fn tls_config(backend: BackendChoice, pki: &Pki) -> Config {
    let mut c = base_config(backend);
    c.listeners = vec![tls_listener("ndjson", pki)];
    c
}

type Tls = StreamOwned<ClientConnection, TcpStream>;

fn connect(addr: SocketAddr, config: Arc<ClientConfig>) -> Tls {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(WAIT)).unwrap();
    tcp.set_nodelay(true).unwrap();
    let conn = ClientConnection::new(config, ServerName::try_from("localhost").unwrap()).unwrap();
    StreamOwned::new(conn, tcp)
}

/// An NDJSON client over TLS.
struct TlsClient {
    reader: BufReader<Tls>,
}

impl TlsClient {
    fn connect(addr: SocketAddr, config: Arc<ClientConfig>) -> TlsClient {
        TlsClient {
            reader: BufReader::with_capacity(1 << 16, connect(addr, config)),
        }
    }

    /// A client connected and subscribed to `stream`.
    fn subscribed(addr: SocketAddr, config: Arc<ClientConfig>, stream: &str) -> TlsClient {
        let mut c = TlsClient::connect(addr, config);
        c.send(&format!(
            r#"{{"type":"subscribe","id":1,"stream":"{stream}"}}"#
        ));
        assert_eq!(c.msg()["type"], "subscribed");
        c
    }

    /// Reads to the end of the stream; its last line.
    fn last_line(&mut self) -> String {
        let mut last = None;
        while let Ok(Some(line)) = self.try_line() {
            last = Some(line);
        }
        last.expect("lines")
    }

    fn send(&mut self, line: &str) {
        self.try_send(line).unwrap();
    }

    fn try_send(&mut self, line: &str) -> std::io::Result<()> {
        let s = self.reader.get_mut();
        s.write_all(line.as_bytes())?;
        s.write_all(b"\n")?;
        s.flush()
    }

    fn try_line(&mut self) -> std::io::Result<Option<String>> {
        let mut s = String::new();
        match self.reader.read_line(&mut s)? {
            0 => Ok(None),
            _ => Ok(Some(s.trim_end_matches('\n').to_owned())),
        }
    }

    fn msg(&mut self) -> Value {
        loop {
            let line = self.try_line().unwrap().expect("a line");
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["type"] != "ping" {
                return v;
            }
        }
    }

    fn version(&self) -> Option<rustls::ProtocolVersion> {
        self.reader.get_ref().conn.protocol_version()
    }
}

#[test]
fn the_push_protocol_runs_over_tls_1_3_and_1_2() {
    let pki = Pki::new("versions");
    on_both_backends(|backend| {
        let server = start(tls_config(backend, &pki));
        for (versions, expected) in [
            (
                &[&rustls::version::TLS13][..],
                rustls::ProtocolVersion::TLSv1_3,
            ),
            (
                &[&rustls::version::TLS12][..],
                rustls::ProtocolVersion::TLSv1_2,
            ),
        ] {
            let mut sub = TlsClient::subscribed(server.addr, pki.client(false, versions), "obs");
            assert_eq!(sub.version(), Some(expected));
            let mut publisher = TlsClient::connect(server.addr, pki.client(false, versions));
            // Many small messages in one write, then one far larger than a TLS record (16 KiB).
            let mut batch = String::new();
            for seq in 0..2_000 {
                batch.push_str(&format!(
                    "{{\"type\":\"publish\",\"message\":{}}}\n",
                    message("obs", seq, 1000)
                ));
            }
            batch.push_str(&format!(
                "{{\"type\":\"publish\",\"id\":\"big\",\"message\":{}}}",
                message("obs", 2_000, 900 << 10)
            ));
            publisher.send(&batch);
            assert_eq!(
                publisher.msg(),
                json!({"type":"published","requestId":"big","delivered":1})
            );
            for seq in 0..=2_000 {
                let v = sub.msg();
                assert_eq!(v["seq"], seq, "{expected:?}");
            }
        }
    });
}

#[test]
fn a_tls_reader_that_stops_reading_is_closed_at_max_outbox_bytes_and_others_keep_going() {
    let pki = Pki::new("stalled");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.limits.backpressure_bytes = 1 << 20;
        config.limits.max_outbox_bytes = 4 << 20;
        let server = start(config);
        let tls13 = [&rustls::version::TLS13];
        let mut stalled = TlsClient::subscribed(server.addr, pki.client(false, &tls13), "obs");
        let mut healthy = TlsClient::subscribed(server.addr, pki.client(false, &tls13), "obs");
        let received = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let counted = Arc::clone(&received);
        let reader = std::thread::spawn(move || {
            for seq in 0..400 {
                assert_eq!(healthy.msg()["seq"], seq);
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
        // 25 MiB in all, never more than 1 MiB ahead of the healthy reader (which is then
        // never near max_outbox_bytes): the stalled one passes it.
        for seq in 0..400 {
            eventually("the healthy reader keeps up", || {
                seq < received.load(std::sync::atomic::Ordering::Relaxed) + 16
            });
            publish(&server.engine, "obs", seq, 64 << 10);
        }
        reader.join().unwrap();
        eventually("the stalled TLS reader is closed", || {
            server.engine.stats().limit_errors >= 1
        });
        // What it reads now ends with the limit error, then the end of the stream.
        let last: Value = serde_json::from_str(&stalled.last_line()).unwrap();
        assert_eq!(last["limit"], "max_outbox_bytes", "{last}");
    });
}

/// A TLS reader that keeps up gets messages larger than `max_outbox_bytes` and is not closed:
/// the ciphertext its socket holds while it reads counts only while the socket refuses it, and
/// what the socket takes first is written before the limit is judged (as for plaintext,
/// `engine_io::a_reader_that_keeps_up_gets_messages_larger_than_max_outbox_bytes`).
#[test]
fn a_tls_reader_that_keeps_up_gets_messages_larger_than_max_outbox_bytes() {
    let pki = Pki::new("keeps-up");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.limits.backpressure_bytes = 16 << 10;
        config.limits.max_outbox_bytes = 64 << 10;
        let server = start(config);
        let mut reader = TlsClient::subscribed(
            server.addr,
            pki.client(false, &[&rustls::version::TLS13]),
            "big",
        );
        for seq in 0..20 {
            assert_eq!(publish(&server.engine, "big", seq, 70_000), 1);
            let got = reader.msg();
            assert_eq!(got["seq"], seq, "{backend:?}: {}", got["type"]);
            assert_eq!(got["pad"].as_str().map(str::len), Some(70_000));
        }
        assert_eq!(server.engine.stats().limit_errors, 0, "{backend:?}");
    });
}

/// The stall rule over TLS: a subscriber that reads nothing of one message larger than
/// `max_outbox_bytes` and the kernel's buffers, and is sent nothing more, is closed at the limit
/// `stall_timeout_ms` after its socket stopped taking ciphertext (not at the liveness timeout).
#[test]
fn a_tls_subscriber_that_reads_nothing_of_one_large_message_is_closed_at_the_stall_timeout() {
    use std::time::{Duration, Instant};
    let pki = Pki::new("stall");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.limits.max_outbox_bytes = 1 << 20;
        config.limits.stall_timeout_ms = 1_000;
        // Neither keepalive nor liveness acts within the test.
        config.outbox.keepalive_interval_ms = 60_000;
        config.outbox.liveness_timeout_ms = 120_000;
        let server = start(config);
        let mut stalled = TlsClient::subscribed(
            server.addr,
            pki.client(false, &[&rustls::version::TLS13]),
            "big",
        );
        let published = Instant::now();
        assert_eq!(publish(&server.engine, "big", 0, 24 << 20), 1);
        eventually("the stalled TLS subscriber is closed", || {
            server.engine.stats().limit_errors >= 1
        });
        let took = published.elapsed();
        assert!(
            took < Duration::from_secs(15),
            "{backend:?}: closed after {took:?}, by the stall rule, not liveness"
        );
        // What it reads now ends with the limit error, then the end of the stream.
        let last = stalled.last_line();
        let tail = &last[last.len().saturating_sub(300)..];
        assert!(
            tail.contains(r#""limit":"max_outbox_bytes""#),
            "{backend:?}: the close names the limit: {tail}"
        );
    });
}

#[test]
fn under_disconnect_a_stalled_tls_reader_is_closed_as_slow_consumer() {
    let pki = Pki::new("disconnect");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.subscriptions.slow_consumer = powerhub::runtime::SlowConsumerChoice::Disconnect;
        config.limits.backpressure_bytes = 1 << 20;
        config.limits.max_outbox_bytes = 64 << 20;
        let server = start(config);
        let mut stalled = TlsClient::subscribed(
            server.addr,
            pki.client(false, &[&rustls::version::TLS13]),
            "obs",
        );
        let mut seq = 0;
        // Small messages: each send's plaintext fits rustls's buffer whole, so only the
        // socket's refusal of ciphertext says the connection is stalled.
        eventually("the stalled TLS reader is disconnected", || {
            for _ in 0..256 {
                publish(&server.engine, "obs", seq, 1000);
                seq += 1;
            }
            server.engine.hub().stats().disconnected >= 1
        });
        let last: Value = serde_json::from_str(&stalled.last_line()).unwrap();
        assert_eq!(last["code"], "slow_consumer", "{last}");
    });
}

#[test]
fn mutual_tls_refuses_a_client_without_a_certificate_of_the_ca() {
    let pki = Pki::new("mutual");
    on_both_backends(|backend| {
        let server = start(mutual_tls_config(backend, &pki));
        let tls13 = [&rustls::version::TLS13];
        let mut with = TlsClient::connect(server.addr, pki.client(true, &tls13));
        with.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(with.msg(), json!({"type":"pong","requestId":1}));
        let mut without = TlsClient::connect(server.addr, pki.client(false, &tls13));
        // TLS 1.3: the client learns of the refusal at its first read.
        without.send(r#"{"type":"ping","id":1}"#);
        let err = without.try_line().unwrap_err();
        assert!(
            err.to_string().to_lowercase().contains("certificate"),
            "a certificate alert: {err}"
        );
    });
}

#[test]
fn a_tls_connection_over_max_connections_is_told_why_through_tls() {
    let pki = Pki::new("over-limit");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.limits.max_connections = 1;
        let server = start(config);
        let tls13 = [&rustls::version::TLS13];
        let mut first = TlsClient::connect(server.addr, pki.client(false, &tls13));
        first.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(first.msg(), json!({"type":"pong","requestId":1}));
        // The second completes its handshake, reads the limit error, then the end of the stream
        // (`close_notify`), not a silent close at the close deadline.
        let mut second = TlsClient::connect(server.addr, pki.client(false, &tls13));
        let started = std::time::Instant::now();
        let v = second.msg();
        assert_eq!(
            (&v["code"], &v["limit"]),
            (&json!("limit_exceeded"), &json!("max_connections")),
            "{v}"
        );
        assert_eq!(
            second.try_line().unwrap(),
            None,
            "the end of the stream after the error"
        );
        assert!(started.elapsed() < WAIT, "said at once");
        first.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(first.msg(), json!({"type":"pong","requestId":2}));
    });
}

#[test]
fn a_tls_connection_that_never_finishes_its_handshake_is_closed_at_the_first_message_deadline() {
    let pki = Pki::new("silent");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.limits.first_message_timeout_ms = 300;
        let server = start(config);
        // Nothing, or a record header cut short: no handshake to encrypt the deadline's error
        // with, so the peer gets what TLS can say, in the clear here (an alert, if anything), then the
        // end of the stream, at the deadline; not 5 s later at the close deadline, holding a
        // slot of `max_connections` meanwhile.
        for sent in [&[][..], &[0x16, 0x03, 0x01]] {
            let mut raw = TcpStream::connect(server.addr).unwrap();
            raw.set_read_timeout(Some(WAIT)).unwrap();
            raw.write_all(sent).unwrap();
            let started = std::time::Instant::now();
            let mut rest = Vec::new();
            raw.read_to_end(&mut rest).unwrap();
            let took = started.elapsed();
            assert!(
                rest.is_empty() || rest[0] == 0x15,
                "only a TLS alert record: {rest:?}"
            );
            assert!(
                took < std::time::Duration::from_secs(3),
                "closed at the deadline, not at the close deadline: {took:?}"
            );
        }
        // A client that handshakes in time is served.
        let mut ok = TlsClient::connect(server.addr, pki.client(false, &[&rustls::version::TLS13]));
        ok.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(ok.msg(), json!({"type":"pong","requestId":1}));
    });
}

/// A shutdown does not wait for TLS handshakes that are not going on: a connection that sent
/// nothing, half a record header, or a whole ClientHello and then nothing more gets what TLS
/// can say (an alert, if anything) and the end of the stream at once, so the server stops long
/// before `shutdown_timeout_ms`, and a subscriber that finished its handshake still gets the
/// `shutdown` error. (Each such connection held the shutdown to its close deadline, 5 s, or to
/// `shutdown_timeout_ms` where that is shorter.)
#[test]
fn a_shutdown_does_not_wait_for_a_tls_handshake_that_is_not_going_on() {
    use std::time::{Duration, Instant};
    let pki = Pki::new("shutdown-handshake");
    on_both_backends(|backend| {
        let mut config = tls_config(backend, &pki);
        config.engine.shutdown_timeout_ms = 20_000;
        let server = start(config);
        let mut subscriber = TlsClient::subscribed(
            server.addr,
            pki.client(false, &[&rustls::version::TLS13]),
            "s",
        );
        let hello = {
            // A client's first flight, as rustls writes it.
            let mut conn = ClientConnection::new(
                pki.client(false, &[&rustls::version::TLS13]),
                ServerName::try_from("localhost").unwrap(),
            )
            .unwrap();
            let mut hello = Vec::new();
            conn.write_tls(&mut hello).unwrap();
            hello
        };
        let stalled: Vec<TcpStream> = [&[][..], &[0x16, 0x03, 0x01], &hello]
            .into_iter()
            .map(|sent| {
                let mut raw = TcpStream::connect(server.addr).unwrap();
                raw.set_read_timeout(Some(WAIT)).unwrap();
                raw.write_all(sent).unwrap();
                raw
            })
            .collect();
        eventually("the connections are accepted", || {
            server.engine.stats().open_connections == 4
        });
        let started = Instant::now();
        server.engine.shutdown().unwrap();
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(3),
            "{backend:?}: the shutdown took {took:?}, as if it waited for the handshakes (the \
             close deadline is 5 s)"
        );
        for mut raw in stalled {
            let mut rest = Vec::new();
            // Whatever the server sent (its handshake flight, an alert), then the end.
            let _ = raw.read_to_end(&mut rest);
        }
        assert!(subscriber.last_line().contains(r#""code":"shutdown""#));
    });
}

/// A server whose one listener is mutual TLS (clients need a certificate of the test CA).
fn mutual_tls_config(backend: BackendChoice, pki: &Pki) -> Config {
    let mut config = base_config(backend);
    let mut l = tls_listener("ndjson", pki);
    l.tls_client_ca = Some(pki.path("ca.pem"));
    config.listeners = vec![l];
    config
}

/// [`mutual_tls_config`] with `[auth]` holding `auth`.
fn mutual_tls_auth_config(backend: BackendChoice, pki: &Pki, auth: &str) -> Config {
    let mut config = mutual_tls_config(backend, pki);
    config.auth = Some(toml::from_str(auth).expect("a valid [auth]"));
    config
}

#[test]
fn a_client_certificate_listed_in_auth_certificates_authenticates_as_its_user() {
    let pki = Pki::new("cert-user");
    let auth = r#"
        [[certificates]]
        subject = "CN=alice"
        permissions = { subscribe = { allow = ["obs/>"] }, publish = { allow = ["obs/>"] } }
    "#;
    on_both_backends(|backend| {
        let server = start(mutual_tls_auth_config(backend, &pki, auth));
        let tls13 = [&rustls::version::TLS13];
        let mut alice = TlsClient::connect(server.addr, pki.client(true, &tls13));
        // Said before the client says anything: the certificate was its credential.
        assert_eq!(
            alice.msg(),
            json!({"type":"authenticated","user":"alice","expiresAt":null})
        );
        alice.send(r#"{"type":"subscribe","id":1,"stream":"obs","deviceId":"d1"}"#);
        assert_eq!(alice.msg()["type"], "subscribed");
        alice.send(r#"{"type":"subscribe","id":2,"stream":"secret"}"#);
        let v = alice.msg();
        assert_eq!(
            (&v["code"], &v["requestId"]),
            (&json!("permission_denied"), &json!(2)),
            "{v}"
        );
        alice.send(r#"{"type":"publish","id":3,"message":{"type":"reading","stream":"obs","deviceId":"d1","n":1}}"#);
        let mut got = [alice.msg(), alice.msg()];
        got.sort_by_key(|v| v["type"] != "reading");
        assert_eq!(got[0]["n"], 1, "{got:?}");
        assert_eq!(got[1]["type"], "published", "{got:?}");
        alice.send(
            r#"{"type":"publish","id":4,"message":{"type":"reading","stream":"other","n":2}}"#,
        );
        assert_eq!(alice.msg()["code"], "permission_denied");
    });
}

#[test]
fn a_connection_is_closed_with_certificate_expired_when_its_client_certificate_expires() {
    let pki = Pki::new("cert-expiry");
    let auth = r#"
        [[certificates]]
        subject = "CN=alice"
        permissions = { subscribe = { allow = ["obs"] } }
    "#;
    on_both_backends(|backend| {
        // Mutual TLS alone, and a certificate that authenticates its user: either way the
        // connection lives no longer than the certificate, and is told why; a certificate
        // that the server's reading could find odd does not escape it. The cases wait for
        // their certificates' expiry side by side.
        std::thread::scope(|scope| {
            for (with_auth, odd) in [(false, false), (true, false), (false, true), (true, true)] {
                let pki = &pki;
                scope.spawn(move || {
                    let config = if with_auth {
                        mutual_tls_auth_config(backend, pki, auth)
                    } else {
                        mutual_tls_config(backend, pki)
                    };
                    let server = start(config);
                    // Two seconds ahead: the handshake's own check of the validity comes well
                    // before it, even on a loaded machine.
                    let (client, not_after) = pki.client_expiring(2, odd);
                    let mut c = TlsClient::connect(server.addr, client);
                    if with_auth {
                        assert_eq!(c.msg()["user"], "alice");
                    }
                    c.send(r#"{"type":"subscribe","id":1,"stream":"obs"}"#);
                    assert_eq!(c.msg()["type"], "subscribed");
                    let tls13 = [&rustls::version::TLS13];
                    let mut other = TlsClient::connect(server.addr, pki.client(true, &tls13));
                    if with_auth {
                        assert_eq!(other.msg()["user"], "alice");
                    }
                    let v = c.msg();
                    assert_eq!(v["code"], "certificate_expired", "{v}");
                    assert!(
                        unix_now() > not_after,
                        "closed before its notAfter passed: {v}"
                    );
                    let message = v["message"].as_str().unwrap();
                    assert!(message.contains(&not_after.to_string()), "{v}");
                    assert_eq!(message.contains("user `alice`"), with_auth, "{v}");
                    assert_eq!(
                        c.try_line().ok().flatten(),
                        None,
                        "the end of the stream after it"
                    );
                    // A connection whose certificate is valid for long stays.
                    other.send(r#"{"type":"ping","id":2}"#);
                    assert_eq!(other.msg()["type"], "pong");
                });
            }
        });
    });
}

#[test]
fn a_client_certificate_not_listed_leaves_the_connection_to_authenticate_with_a_token() {
    let pki = Pki::new("cert-unlisted");
    let auth = r#"
        [[tokens]]
        token = "alice-token"
        user = "alice"
        permissions = { subscribe = { allow = ["obs"] } }

        [[certificates]]
        subject = "CN=bob"
    "#;
    on_both_backends(|backend| {
        let server = start(mutual_tls_auth_config(backend, &pki, auth));
        let mut c = TlsClient::connect(server.addr, pki.client(true, &[&rustls::version::TLS13]));
        c.send(r#"{"type":"subscribe","id":1,"stream":"obs"}"#);
        assert_eq!(c.msg()["code"], "auth_required");
        c.send(r#"{"type":"auth","id":2,"token":"alice-token"}"#);
        assert_eq!(c.msg()["user"], "alice");
        c.send(r#"{"type":"subscribe","id":3,"stream":"obs"}"#);
        assert_eq!(c.msg()["type"], "subscribed");
    });
}

#[test]
fn plaintext_to_a_tls_port_and_tls_to_a_plaintext_port_are_answered_cleanly() {
    let pki = Pki::new("mismatch");
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.listeners.push(tls_listener("ndjson", &pki));
        let server = start(config);
        let tls_addr = match &server.engine.listeners()[1].addr {
            powerhub::runtime::ListenAddr::Tcp(a) => *a,
            other => panic!("{other}"),
        };
        // NDJSON to the TLS port: a TLS alert, then the end of the stream, at once.
        let mut plain = Client::connect(tls_addr);
        plain.send(r#"{"type":"ping","id":1}"#);
        let rest = plain.rest();
        assert_eq!(rest.first(), Some(&0x15), "a TLS alert record: {rest:?}");
        // TLS to the plaintext port: the error in plaintext, then the end of the stream.
        let mut tls = connect(server.addr, pki.client(false, &[&rustls::version::TLS13]));
        let err = tls
            .write_all(b"{}\n")
            .and_then(|()| tls.read(&mut [0; 64]).map(drop));
        assert!(err.is_err(), "the handshake cannot succeed");
        let mut raw = TcpStream::connect(server.addr).unwrap();
        raw.set_read_timeout(Some(WAIT)).unwrap();
        raw.write_all(&[0x16, 0x03, 0x01, 0x00, 0x05, 1, 0, 0, 1, 0])
            .unwrap();
        let mut text = String::new();
        raw.read_to_string(&mut text).unwrap();
        let v: Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(v["code"], "tls_not_enabled", "{v}");
        // Both listeners still serve.
        let mut ok = TlsClient::connect(tls_addr, pki.client(false, &[&rustls::version::TLS13]));
        ok.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(ok.msg()["type"], "pong");
        let mut ok = Client::connect(server.addr);
        ok.send(r#"{"type":"ping","id":3}"#);
        assert_eq!(ok.msg()["type"], "pong");
    });
}

#[test]
fn websocket_runs_over_tls() {
    let pki = Pki::new("wss");
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.listeners = vec![tls_listener("websocket", &pki)];
        let mut registry = ProtocolRegistry::with_builtins();
        registry
            .register(Arc::new(
                powerhub_websocket::WebSocketFactory::new(Default::default()).unwrap(),
            ))
            .unwrap();
        let server = start_with(config, &registry);
        let stream = connect(server.addr, pki.client(false, &[&rustls::version::TLS13]));
        let (mut ws, _) =
            tungstenite::client(format!("wss://localhost:{}/", server.addr.port()), stream)
                .expect("upgraded over TLS");
        ws.send(tungstenite::Message::text(
            r#"{"type":"subscribe","id":1,"stream":"obs"}"#,
        ))
        .unwrap();
        let read = |ws: &mut tungstenite::WebSocket<Tls>| loop {
            if let tungstenite::Message::Text(t) = ws.read().unwrap() {
                return serde_json::from_str::<Value>(t.as_str()).unwrap();
            }
        };
        assert_eq!(read(&mut ws)["type"], "subscribed");
        publish(&server.engine, "obs", 7, 100_000);
        assert_eq!(read(&mut ws)["seq"], 7);
    });
}

fn registry() -> ProtocolRegistry {
    ProtocolRegistry::with_builtins()
}

fn start_error(config: Config) -> String {
    match Engine::start(config, &registry()) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("the engine must refuse the config"),
    }
}

#[test]
fn tls_configuration_errors_name_the_key_and_the_file() {
    let pki = Pki::new("errors");
    let mut config = base_config(BackendChoice::Auto);
    let mut l = ListenerConfig::tcp("ndjson", "127.0.0.1:0");
    l.tls_cert = Some(pki.path("server.pem"));
    config.listeners = vec![l];
    let err = start_error(config.clone());
    assert!(
        err.contains("listener[0]") && err.contains("tls_key"),
        "{err}"
    );

    config.listeners = vec![ListenerConfig::tcp("ndjson", "127.0.0.1:0")
        .with_tls(pki.path("server.pem"), pki.path("missing.key"))];
    let err = start_error(config.clone());
    assert!(
        err.contains("tls_key") && err.contains("missing.key"),
        "{err}"
    );

    config.listeners = vec![ListenerConfig::tcp("ndjson", "127.0.0.1:0")
        .with_tls(pki.path("server.key"), pki.path("server.key"))];
    let err = start_error(config.clone());
    assert!(err.contains("tls_cert"), "{err}");

    let mut l = ListenerConfig::unix("ndjson", pki.path("push.sock"))
        .with_tls(pki.path("server.pem"), pki.path("server.key"));
    l.address = None;
    config.listeners = vec![l];
    let err = start_error(config.clone());
    assert!(err.contains("tls_cert") && err.contains("Unix"), "{err}");
    assert!(!err.contains("Some("), "the path as written: {err}");
    // Said before the files are read: a Unix listener with TLS is refused even when they are
    // missing.
    let mut l = ListenerConfig::unix("ndjson", pki.path("push2.sock"))
        .with_tls(pki.path("missing.pem"), pki.path("missing.key"));
    l.address = None;
    config.listeners = vec![l];
    let err = start_error(config);
    assert!(err.contains("Unix") && err.contains("missing.pem"), "{err}");
}

#[test]
fn a_reload_serves_new_connections_the_new_certificate() {
    let old = Pki::new("reload-old");
    let new = Pki::new("reload-new");
    on_both_backends(|backend| {
        // The server reads its files from a directory of its own, overwritten for the reload.
        let dir = std::env::temp_dir().join(format!(
            "powerhub-tls-reload-{}-{backend:?}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let copy = |pki: &Pki| {
            for f in ["server.pem", "server.key"] {
                std::fs::copy(pki.path(f), dir.join(f)).unwrap();
            }
        };
        copy(&old);
        let mut config = base_config(backend);
        config.listeners = vec![ListenerConfig::tcp("ndjson", "127.0.0.1:0")
            .with_tls(dir.join("server.pem"), dir.join("server.key"))];
        let server = start(config);
        let tls13 = [&rustls::version::TLS13];
        let mut before = TlsClient::connect(server.addr, old.client(false, &tls13));
        before.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(before.msg()["type"], "pong");

        // Files that cannot be used: refused, the running certificate stays.
        std::fs::write(dir.join("server.key"), "not a key").unwrap();
        let err = server.engine.reload_tls().unwrap_err().to_string();
        assert!(err.contains("tls_key"), "{err}");
        let mut still = TlsClient::connect(server.addr, old.client(false, &tls13));
        still.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(still.msg()["type"], "pong");

        copy(&new);
        server.engine.reload_tls().unwrap();
        let mut after = TlsClient::connect(server.addr, new.client(false, &tls13));
        after.send(r#"{"type":"ping","id":3}"#);
        assert_eq!(after.msg()["type"], "pong");
        let mut stale = TlsClient::connect(server.addr, old.client(false, &tls13));
        let refused = stale
            .try_send(r#"{"type":"ping","id":4}"#)
            .and_then(|()| stale.try_line());
        assert!(
            refused.is_err(),
            "the old CA does not verify the new certificate"
        );
        // The connection opened before the reload keeps its session.
        before.send(r#"{"type":"ping","id":5}"#);
        assert_eq!(before.msg()["type"], "pong");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A TLS `close_notify` ends the client's stream as a TCP end of stream does: its last line
/// without a newline is answered (a publish reaches the connection's own subscription), then
/// the server closes, though the client's TCP sending side stays open.
#[test]
fn a_tls_close_notify_ends_the_stream_and_its_last_line_is_read() {
    let pki = Pki::new("close-notify");
    on_both_backends(|backend| {
        let server = start(tls_config(backend, &pki));
        let mut c = TlsClient::subscribed(
            server.addr,
            pki.client(false, &[&rustls::version::TLS13]),
            "obs",
        );
        let s = c.reader.get_mut();
        let last = format!(
            r#"{{"type":"publish","id":"p","message":{}}}"#,
            message("obs", 7, 10)
        );
        s.write_all(last.as_bytes()).unwrap();
        s.conn.send_close_notify();
        s.flush().unwrap();
        assert_eq!(
            c.msg(),
            json!({"type":"published","requestId":"p","delivered":1})
        );
        assert_eq!(c.msg()["seq"], 7);
        assert_eq!(
            c.try_line().unwrap_or(None),
            None,
            "closed after the delivery"
        );
    });
}
