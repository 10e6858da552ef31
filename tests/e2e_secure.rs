//! End to end with authentication and TLS: `powerhub serve --config FILE` as a process, its test
//! certificates made by `scripts/make-test-certs.sh` (openssl), driven by real clients: Python's
//! `ssl` and the `websockets` library (`tests/e2e_secure_client.py`: NDJSON over TLS 1.3 and 1.2,
//! `wss://`, every refused token named, origins, 10 000 failed authentications against the
//! server's RSS, a SIGHUP rotation of a token) and `openssl s_client`. Runs on both backends.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

struct Server {
    child: Child,
    listeners: Vec<(String, String)>,
    backend: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(certs: &Path) -> String {
    let cert = certs.join("server.pem");
    let key = certs.join("server.key");
    let ca = certs.join("ca.pem");
    format!(
        r#"
[engine]
shards = 2

[[listener]]
protocol = "ndjson"
address = "127.0.0.1:0"

[[listener]]
protocol = "ndjson"
address = "127.0.0.1:0"
tls_cert = "{cert}"
tls_key = "{key}"

[[listener]]
protocol = "websocket"
address = "127.0.0.1:0"
tls_cert = "{cert}"
tls_key = "{key}"
allowed_origins = ["https://app.example"]

[[listener]]
protocol = "ndjson"
address = "127.0.0.1:0"
tls_cert = "{cert}"
tls_key = "{key}"
tls_client_ca = "{ca}"

[[auth.certificates]]
subject = "CN=alice"
permissions = {{ subscribe = {{ allow = ["obs/*"] }}, publish = {{ allow = ["obs/*"] }} }}

[[auth.tokens]]
token = "reader-token"
user = "reader"
permissions = {{ subscribe = {{ allow = ["obs", "obs/*", "$stats"] }} }}

[auth.jwt]
algorithm = "HS256"
secret = "a shared secret of at least thirty-two bytes"
audience = "powerhub"
"#,
        cert = cert.display(),
        key = key.display(),
        ca = ca.display()
    )
}

fn spawn(backend: &str, config: &Path) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_powerhub"))
        .args(["serve", "--backend", backend, "--config"])
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("powerhub starts");
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut listeners = Vec::new();
    let mut backend_name = String::new();
    loop {
        let mut line = String::new();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "powerhub exited before it was ready"
        );
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["listening", proto, addr] => listeners.push((proto.to_string(), addr.to_string())),
            ["backend", name] => backend_name = name.to_string(),
            ["ready"] => break,
            _ => panic!("unexpected output: {line}"),
        }
    }
    Server {
        child,
        listeners,
        backend: backend_name,
    }
}

/// `openssl s_client` to the TLS NDJSON listener: the handshake verifies against the test CA,
/// and the push protocol answers through it.
fn openssl_s_client(ca: &Path, addr: &str) {
    let mut child = Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            addr,
            "-servername",
            "localhost",
            "-quiet",
        ])
        .args(["-verify_return_error", "-CAfile"])
        .arg(ca)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("openssl runs (scripts/install-test-deps.sh installs it)");
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"{\"type\":\"auth\",\"id\":1,\"token\":\"reader-token\"}\n{\"type\":\"ping\",\"id\":2}\n")
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    for _ in 0..2 {
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        lines.push(line.trim().to_owned());
    }
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
    assert_eq!(
        lines,
        [
            r#"{"type":"authenticated","requestId":1,"user":"reader","expiresAt":null}"#,
            r#"{"type":"pong","requestId":2}"#
        ],
        "openssl s_client: {err}"
    );
}

fn run(backend: &str) {
    let dir = std::env::temp_dir().join(format!(
        "powerhub-e2e-secure-{}-{backend}",
        std::process::id()
    ));
    let certs = dir.join("certs");
    let made = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/make-test-certs.sh"
        ))
        .arg(&certs)
        .output()
        .expect("bash runs");
    assert!(made.status.success(), "make-test-certs.sh: {made:?}");
    let config_path = dir.join("powerhub.toml");
    std::fs::write(&config_path, config(&certs)).unwrap();
    let server = spawn(backend, &config_path);
    if backend == "io_uring" && server.backend != "io_uring" {
        eprintln!("notice: io_uring is not available here; the io_uring run is skipped");
        return;
    }
    let addrs: Vec<&str> = server.listeners.iter().map(|(_, a)| a.as_str()).collect();
    assert_eq!(addrs.len(), 4, "{:?}", server.listeners);
    openssl_s_client(&certs.join("ca.pem"), addrs[1]);
    let status = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/e2e_secure_client.py"
        ))
        .arg(&config_path)
        .arg(certs.join("ca.pem"))
        .args(&addrs[..3])
        .arg(server.child.id().to_string())
        .arg(addrs[3])
        .status()
        .expect("python3 runs");
    assert!(
        status.success(),
        "the Python client's checks failed ({backend})"
    );
    drop(server);
    std::thread::sleep(Duration::from_millis(10));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn serve_with_auth_and_tls_against_python_ssl_websockets_and_openssl_io_uring() {
    run("io_uring");
}

#[test]
fn serve_with_auth_and_tls_against_python_ssl_websockets_and_openssl_epoll() {
    run("epoll");
}
