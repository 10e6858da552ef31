//! The engine over WebSocket with clients written by others, on loopback: the runtime's shards
//! (io_uring or epoll, as `POWERHUB_BACKEND` says) serve the push protocol through the
//! `websocket` plugin, registered the way a service registers a transport.
//!
//! - Python `websockets` runs `tests/websocket_client.py --mode push`: handshake (and a refused
//!   one), ping/pong, close handshake, bad frames closed with 1002/1007/1009, subscribe, a
//!   message published by another client delivered byte for byte, fragmented commands, and a
//!   subscriber that stops reading while another keeps receiving every message;
//! - the web page in headless Chromium: it connects, subscribes, shows a message published by an
//!   NDJSON client, and shows the hub's stats that the engine publishes on `$stats`; the
//!   screenshot is kept in `$CARGO_TARGET_TMPDIR/websocket_page/page.png`.
//!
//! Needs `python3` with `websockets` and `chromium` (scripts/install-test-deps.sh installs
//! them); `POWERHUB_SKIP_PYTHON=1` / `POWERHUB_SKIP_BROWSER=1` skip those parts where they
//! cannot be installed.

#[path = "../plugins/websocket/tests/util/devtools.rs"]
mod devtools;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use powerhub::runtime::{Config, Engine, ListenAddr, ListenerConfig, ProtocolRegistry};
use powerhub_websocket::{WebSocketConfig, WebSocketFactory};
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(30);

/// A running engine with a WebSocket (page on) and an NDJSON listener on free loopback ports.
struct Server {
    engine: Option<Engine>,
    websocket: SocketAddr,
    ndjson: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(engine) = self.engine.take() {
            let _ = engine.shutdown();
        }
    }
}

fn out_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A fresh Chromium profile folder in `dir`.
fn fresh_profile(dir: &Path) -> PathBuf {
    let profile = dir.join(format!("profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&profile);
    std::fs::create_dir_all(&profile).unwrap();
    profile
}

/// The built-in protocols and the WebSocket plugin with its page on, as `powerhub serve`
/// registers them.
fn registry_with_page() -> ProtocolRegistry {
    let mut registry = ProtocolRegistry::with_builtins();
    let websocket = WebSocketFactory::new(WebSocketConfig::default().with_serve_page(true))
        .expect("a valid websocket config");
    registry
        .register(Arc::new(websocket))
        .expect("websocket is not registered yet");
    registry
}

/// An engine of `shards` shards serving the web page on `listener` (WebSocket), with
/// authentication on: one token, `token`, whose user may subscribe to `demo` and `$stats`.
fn start_page_engine(listener: ListenerConfig, shards: usize, token: &str) -> (Engine, SocketAddr) {
    let registry = registry_with_page();
    let mut config = Config::default();
    config.engine.shards = shards;
    config.engine.stats_interval_ms = 200;
    config.listeners.push(listener);
    config.auth = Some(
        toml::from_str(&format!(
            r#"
            [[tokens]]
            token = "{token}"
            user = "page"
            permissions = {{ subscribe = {{ allow = ["demo", "$stats"] }} }}
            "#
        ))
        .unwrap(),
    );
    let engine = Engine::start(config, &registry).expect("the engine starts");
    let ListenAddr::Tcp(addr) = engine.listeners()[0].addr.clone() else {
        panic!("tcp")
    };
    (engine, addr)
}

fn start_server() -> Server {
    let registry = registry_with_page();
    let mut config = Config::default();
    config.engine.shards = 2;
    config.engine.stats_interval_ms = 200;
    // Keepalive fast enough for the Python client to see pings and be reaped without pongs; the
    // liveness timeout leaves a busy client (parsing 256 KiB messages on a loaded machine) room
    // to answer.
    config.outbox.keepalive_interval_ms = 300;
    config.outbox.liveness_timeout_ms = 4000;
    config
        .listeners
        .push(ListenerConfig::tcp("websocket", "127.0.0.1:0"));
    config
        .listeners
        .push(ListenerConfig::tcp("ndjson", "127.0.0.1:0"));
    let engine = Engine::start(config, &registry).expect("the engine starts");
    let addr = |protocol: &str| {
        let listener = engine
            .listeners()
            .iter()
            .find(|l| l.protocol == protocol)
            .unwrap();
        match &listener.addr {
            ListenAddr::Tcp(addr) => *addr,
            other => panic!("{protocol} listens on {other:?}"),
        }
    };
    Server {
        websocket: addr("websocket"),
        ndjson: addr("ndjson"),
        engine: Some(engine),
    }
}

#[test]
fn websocket_page_is_served_by_the_engine() {
    let server = start_server();
    let response = plain_get(server.websocket);
    assert!(
        response.starts_with("HTTP/1.1 200 OK\r\n"),
        "{response:.200}"
    );
    assert!(response.contains("Content-Type: text/html"));
    assert!(response.ends_with(powerhub_websocket::INDEX_HTML));
}

/// The response head of a plain `GET /` (no `Upgrade`).
fn plain_get(addr: SocketAddr) -> String {
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(DEADLINE)).unwrap();
    sock.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut response = String::new();
    sock.read_to_string(&mut response).unwrap();
    response
}

#[test]
fn a_listener_with_serve_page_false_answers_a_plain_get_with_426() {
    // The page on, as `powerhub serve` registers the plugin, unless a listener turns it off.
    let registry = registry_with_page();
    let config = Config::from_toml(
        r#"
        [[listener]]
        protocol = "websocket"
        address = "127.0.0.1:0"
        serve_page = false

        [[listener]]
        protocol = "websocket"
        address = "127.0.0.1:0"
        "#,
        None,
    )
    .expect("serve_page is a listener key");
    let engine = Engine::start(config, &registry).expect("the engine starts");
    let addrs: Vec<SocketAddr> = engine
        .listeners()
        .iter()
        .map(|l| match &l.addr {
            ListenAddr::Tcp(a) => *a,
            other => panic!("tcp, not {other:?}"),
        })
        .collect();
    let off = plain_get(addrs[0]);
    assert!(
        off.starts_with("HTTP/1.1 426 Upgrade Required\r\n"),
        "{off:.200}"
    );
    let on = plain_get(addrs[1]);
    assert!(on.starts_with("HTTP/1.1 200 OK\r\n"), "{on:.200}");
    // The page setting leaves the endpoint as it is.
    let stream = TcpStream::connect(addrs[0]).unwrap();
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    let (mut ws, _) =
        tungstenite::client(format!("ws://{}/", addrs[0]), stream).expect("the upgrade works");
    ws.send(tungstenite::Message::text(r#"{"type":"ping","id":1}"#))
        .unwrap();
    let reply = ws.read().unwrap();
    assert!(reply.to_text().unwrap().contains("pong"), "{reply:?}");
    engine.shutdown().unwrap();
}

#[test]
fn websocket_python_client_against_the_engine() {
    if std::env::var_os("POWERHUB_SKIP_PYTHON").is_some() {
        eprintln!("POWERHUB_SKIP_PYTHON is set: the Python client test is skipped");
        return;
    }
    let server = start_server();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/websocket_client.py");
    let output = Command::new("python3")
        .arg(&script)
        .args(["--mode", "push", &format!("ws://{}/", server.websocket)])
        .output()
        .expect("python3 runs (scripts/install-test-deps.sh installs it and websockets)");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    eprintln!("{stdout}{stderr}");
    assert!(
        output.status.success(),
        "the Python client reported failures:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains(" 0 failed"), "{stdout}");
}

/// An NDJSON client of the push protocol.
struct Ndjson {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Ndjson {
    fn connect(addr: SocketAddr) -> Self {
        let sock = TcpStream::connect(addr).unwrap();
        sock.set_read_timeout(Some(DEADLINE)).unwrap();
        Ndjson {
            writer: sock.try_clone().unwrap(),
            reader: BufReader::new(sock),
        }
    }

    /// Sends `command` and returns the reply carrying its `id`.
    fn request(&mut self, command: Value) -> Value {
        writeln!(self.writer, "{command}").unwrap();
        loop {
            let mut line = String::new();
            assert!(
                self.reader.read_line(&mut line).unwrap() > 0,
                "the server closed"
            );
            let reply: Value = serde_json::from_str(&line).unwrap();
            if reply["requestId"] == command["id"] {
                return reply;
            }
        }
    }
}

#[test]
fn websocket_page_in_chromium_against_the_engine() {
    if std::env::var_os("POWERHUB_SKIP_BROWSER").is_some() {
        eprintln!("POWERHUB_SKIP_BROWSER is set: the browser test is skipped");
        return;
    }
    let server = start_server();
    let dir = out_dir("websocket_page");
    let profile = fresh_profile(&dir);
    let (_browser, mut page) = devtools::launch_chromium(&profile);
    page.open(&format!("http://{}/?stream=demo", server.websocket));
    let deadline = Instant::now() + DEADLINE;
    page.wait_for(
        "document.body && document.body.dataset.state === 'open'",
        "connected",
        deadline,
    );

    // Another client, over NDJSON, publishes until the page's subscription is in place.
    let mut publisher = Ndjson::connect(server.ndjson);
    let message =
        json!({ "type": "price", "stream": "demo", "price": 42000, "note": "over NDJSON" });
    for n in 0.. {
        let reply = publisher.request(json!({ "type": "publish", "id": n, "message": message }));
        assert_eq!(reply["type"], "published", "{reply}");
        if reply["delivered"].as_u64() >= Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the page never subscribed to demo"
        );
        thread::sleep(Duration::from_millis(50));
    }
    page.wait_for(
        "Number(document.body.dataset.received) >= 1",
        "showed the published message",
        deadline,
    );
    let shown =
        page.eval("JSON.parse(document.querySelector('#messages li.message .data').textContent)");
    assert_eq!(shown, message);

    // The stats the server publishes on the stats stream: at least the page's two subscriptions.
    page.wait_for(
        "Number(document.getElementById('stat-subscribers').textContent) >= 2 \
         && Number(document.getElementById('stat-published').textContent) >= 1 \
         && document.querySelectorAll('#subscribers tr').length >= 2",
        "showed the hub's stats",
        deadline,
    );
    let path = dir.join("page.png");
    let png = page.screenshot(&path);
    eprintln!("screenshot: {}", path.display());
    assert!(png.starts_with(b"\x89PNG"));
    let _ = std::fs::remove_dir_all(&profile);
}

/// The web page over `wss://` in headless Chromium, against an engine with TLS on its WebSocket
/// listener and authentication on: the page is served over HTTPS, sends its token in the upgrade
/// (`?token=`), its origin is the listener's own (the default with `[auth]`), and it shows a
/// message published in-process and the stats its token may read.
#[test]
fn websocket_page_in_chromium_over_tls_with_a_token() {
    if std::env::var_os("POWERHUB_SKIP_BROWSER").is_some() {
        eprintln!("POWERHUB_SKIP_BROWSER is set: the browser test is skipped");
        return;
    }
    let dir = out_dir("websocket_page_tls");
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("server.key"), key.serialize_pem()).unwrap();
    let listener = ListenerConfig::tcp("websocket", "127.0.0.1:0")
        .with_tls(dir.join("server.pem"), dir.join("server.key"));
    let (engine, addr) = start_page_engine(listener, 2, "page-token");
    let profile = fresh_profile(&dir);
    let (_browser, mut page) =
        devtools::launch_chromium_with(&profile, &["--ignore-certificate-errors"]);
    page.open(&format!(
        "https://localhost:{}/?stream=demo&token=page-token",
        addr.port()
    ));
    let deadline = Instant::now() + DEADLINE;
    page.wait_for(
        "document.body && document.body.dataset.state === 'open'",
        "connected over wss:// with its token",
        deadline,
    );
    let message = json!({ "type": "price", "stream": "demo", "price": 7, "note": "over TLS" });
    let m = powerhub::hub::Message::json(message.to_string()).unwrap();
    while engine
        .hub()
        .publish("demo", m.clone(), powerhub::hub::PublishOptions::default())
        .unwrap()
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the page never subscribed to demo"
        );
        thread::sleep(Duration::from_millis(50));
    }
    page.wait_for(
        "Number(document.body.dataset.received) >= 1",
        "showed the published message",
        deadline,
    );
    let shown =
        page.eval("JSON.parse(document.querySelector('#messages li.message .data').textContent)");
    assert_eq!(shown, message);
    page.wait_for(
        "Number(document.getElementById('stat-subscribers').textContent) >= 2",
        "showed the hub's stats (its token may read $stats)",
        deadline,
    );
    let png = page.screenshot(&dir.join("page-tls.png"));
    assert!(png.starts_with(b"\x89PNG"));
    drop(page);
    let _ = engine.shutdown();
    let _ = std::fs::remove_dir_all(&profile);
}

/// With authentication on, the web page opened without a token asks for one (the server said
/// `auth_required`), connects again with the token entered, and shows what is published.
#[test]
fn websocket_page_asks_for_a_token_when_the_server_needs_one() {
    if std::env::var_os("POWERHUB_SKIP_BROWSER").is_some() {
        eprintln!("POWERHUB_SKIP_BROWSER is set: the browser test is skipped");
        return;
    }
    let dir = out_dir("websocket_page_token");
    let listener = ListenerConfig::tcp("websocket", "127.0.0.1:0");
    let (engine, addr) = start_page_engine(listener, 1, "typed-token");
    let profile = fresh_profile(&dir);
    let (_browser, mut page) = devtools::launch_chromium(&profile);
    page.open(&format!("http://{addr}/?stream=demo"));
    let deadline = Instant::now() + DEADLINE;
    page.wait_for(
        "document.body && document.body.dataset.state === 'auth' \
         && !document.getElementById('token-form').hidden",
        "asked for a token",
        deadline,
    );
    let png = page.screenshot(&dir.join("page-token.png"));
    assert!(png.starts_with(b"\x89PNG"));
    page.eval(
        "document.getElementById('token').value = 'typed-token'; \
         document.getElementById('token-form').requestSubmit(); true",
    );
    page.wait_for(
        "document.body.dataset.state === 'open' && document.getElementById('token-form').hidden",
        "connected with the token entered",
        deadline,
    );
    let message = json!({ "type": "price", "stream": "demo", "price": 9 });
    let m = powerhub::hub::Message::json(message.to_string()).unwrap();
    while engine
        .hub()
        .publish("demo", m.clone(), powerhub::hub::PublishOptions::default())
        .unwrap()
        == 0
    {
        assert!(
            Instant::now() < deadline,
            "the page never subscribed to demo"
        );
        thread::sleep(Duration::from_millis(50));
    }
    page.wait_for(
        "Number(document.body.dataset.received) >= 1",
        "showed the published message",
        deadline,
    );
    drop(page);
    let _ = engine.shutdown();
    let _ = std::fs::remove_dir_all(&profile);
}
