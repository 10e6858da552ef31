//! The web page in headless Chromium, served by the codec over loopback TCP.
//!
//! A small test server stands in for the push server: it drives one codec per connection,
//! keeps a topic → subscribers table, answers `subscribe` and `publish` as docs/protocol.md
//! says (a published message is delivered as is to the topics of its stream and device), and
//! publishes its counters to the stats stream every 100 ms as
//! `{"type":"stats","stream":"$stats","subscribers":..,"list":[..],..}`. Chromium loads the
//! page; the test publishes a message from a second client (tungstenite) once the page has
//! subscribed, then waits, through the DevTools protocol, until the page shows the message and
//! the stats, and keeps a screenshot under `$CARGO_TARGET_TMPDIR/page_chromium/`.
//!
//! Needs `chromium` on the PATH (installed by the test dependency script); set
//! `POWERHUB_SKIP_BROWSER=1` to skip where no browser can be installed.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use powerhub_plugin::{BytesMut, Inbound, ProtocolLimits, ProtocolOutput, StreamProtocol};
use powerhub_websocket::{ServerFrameHeader, WebSocketConfig, WebSocketFactory};
use serde_json::{json, Value};
use tungstenite::Message;

#[path = "util/devtools.rs"]
mod devtools;

use devtools::launch_chromium;

const STATS_STREAM: &str = "$stats";
const DEADLINE: Duration = Duration::from_secs(30);

type Writer = Arc<Mutex<TcpStream>>;

#[derive(Default)]
struct Hub {
    subs: Mutex<HashMap<String, Vec<(String, Writer)>>>,
    published: AtomicU64,
    delivered: AtomicU64,
    stop: AtomicBool,
}

impl Hub {
    /// Delivers `message` (a push-protocol message object) to every subscriber of `topic`.
    fn publish(&self, topic: &str, message: &Value) -> usize {
        let text = message.to_string();
        let header = ServerFrameHeader::text(text.len());
        let subs = self.subs.lock().unwrap();
        let mut delivered = 0;
        for (_, writer) in subs.get(topic).into_iter().flatten() {
            let mut w = writer.lock().unwrap();
            if w.write_all(header.as_bytes())
                .and_then(|()| w.write_all(text.as_bytes()))
                .is_ok()
            {
                delivered += 1;
            }
        }
        if topic != STATS_STREAM {
            self.published.fetch_add(1, Ordering::Relaxed);
            self.delivered
                .fetch_add(delivered as u64, Ordering::Relaxed);
        }
        delivered
    }

    /// The stats message the page expects on the stats stream.
    fn stats(&self) -> Value {
        let subs = self.subs.lock().unwrap();
        let list: Vec<Value> = subs
            .iter()
            .flat_map(|(topic, subs)| {
                subs.iter().map(move |(id, _)| {
                    json!({ "id": id, "topic": topic, "queued": 0, "dropped": 0, "bytesSent": 0, "inFlight": false })
                })
            })
            .collect();
        json!({
            "type": "stats",
            "stream": STATS_STREAM,
            "subscribers": list.len(),
            "topics": subs.len(),
            "published": self.published.load(Ordering::Relaxed),
            "delivered": self.delivered.load(Ordering::Relaxed),
            "dropped": 0,
            "disconnected": 0,
            "bytesOut": 0,
            "encoded": 0,
            "list": list,
        })
    }
}

/// Serves connections until the hub stops; returns the port.
fn start_server(hub: Arc<Hub>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let factory = WebSocketFactory::new(WebSocketConfig::default().with_serve_page(true)).unwrap();
    let accept_hub = Arc::clone(&hub);
    thread::spawn(move || {
        let mut next_id = 0;
        while !accept_hub.stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((sock, _)) => {
                    next_id += 1;
                    let (hub, factory) = (Arc::clone(&accept_hub), factory.clone());
                    thread::spawn(move || serve(sock, format!("client-{next_id}"), &hub, &factory));
                }
                Err(_) => thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    thread::spawn(move || {
        while !hub.stop.load(Ordering::Relaxed) {
            hub.publish(STATS_STREAM, &hub.stats());
            thread::sleep(Duration::from_millis(100));
        }
    });
    port
}

fn serve(sock: TcpStream, id: String, hub: &Hub, factory: &WebSocketFactory) {
    sock.set_nonblocking(false).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let writer: Writer = Arc::new(Mutex::new(sock.try_clone().unwrap()));
    let mut sock = sock;
    let mut conn = factory.connection(&ProtocolLimits::default());
    let (mut input, mut out, mut buf) = (BytesMut::new(), ProtocolOutput::default(), [0u8; 4096]);
    while !hub.stop.load(Ordering::Relaxed) {
        let n = match sock.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                continue
            }
            Err(_) => break,
        };
        input.extend_from_slice(&buf[..n]);
        let result = conn.decode(&mut input, &mut out);
        let _ = writer.lock().unwrap().write_all(&out.urgent);
        let mut done = result.is_err();
        for event in out.events.drain(..) {
            match event {
                Inbound::Text(text) => {
                    let Ok(cmd) = serde_json::from_slice::<Value>(&text) else {
                        continue;
                    };
                    let reply = command(hub, &id, &writer, &cmd);
                    let header = ServerFrameHeader::text(reply.len());
                    let mut w = writer.lock().unwrap();
                    let _ = w
                        .write_all(header.as_bytes())
                        .and_then(|()| w.write_all(reply.as_bytes()));
                }
                Inbound::Close { .. } => done = true,
                _ => {}
            }
        }
        out.clear();
        if done {
            break;
        }
    }
    for subs in hub.subs.lock().unwrap().values_mut() {
        subs.retain(|(sub, _)| *sub != id);
    }
    let _ = sock.shutdown(Shutdown::Both);
}

/// Topics of a message or subscription (docs/protocol.md): the stream, and `stream/device`.
fn topics(stream: &str, device: &Value) -> Vec<String> {
    let mut topics = vec![stream.to_owned()];
    if let Some(device) = device.as_str() {
        topics.push(format!("{stream}/{device}"));
    }
    topics
}

/// Runs one push-protocol command; returns the reply.
fn command(hub: &Hub, conn_id: &str, writer: &Writer, cmd: &Value) -> String {
    let stream = cmd["stream"].as_str().unwrap_or_default();
    match cmd["type"].as_str() {
        Some("subscribe") => {
            let topic = topics(stream, &cmd["deviceId"]).pop().unwrap();
            let mut subs = hub.subs.lock().unwrap();
            let subscribers = subs.entry(topic).or_default();
            subscribers.push((conn_id.to_owned(), Arc::clone(writer)));
            let sub_id = format!("{stream}-{}", subscribers.len());
            json!({ "type": "subscribed", "requestId": cmd["id"], "subscriptionId": sub_id, "stream": stream })
        }
        Some("publish") => {
            let message = &cmd["message"];
            let stream = message["stream"].as_str().unwrap_or_default();
            let delivered: usize =
                topics(stream, &message["deviceId"]).iter().map(|t| hub.publish(t, message)).sum();
            json!({ "type": "published", "requestId": cmd["id"], "delivered": delivered })
        }
        _ => json!({ "type": "error", "requestId": cmd["id"], "code": "unknown_command", "message": "unknown command" }),
    }
    .to_string()
}

#[test]
fn page_in_chromium_connects_subscribes_and_shows_messages_and_stats() {
    if std::env::var_os("POWERHUB_SKIP_BROWSER").is_some() {
        eprintln!("POWERHUB_SKIP_BROWSER is set: the browser test is skipped");
        return;
    }
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("page_chromium");
    let profile = out_dir.join(format!("profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&profile);
    std::fs::create_dir_all(&profile).unwrap();

    let hub = Arc::new(Hub::default());
    let port = start_server(Arc::clone(&hub));
    let (_browser, mut devtools) = launch_chromium(&profile);
    devtools.open(&format!("http://127.0.0.1:{port}/?stream=demo"));
    let deadline = Instant::now() + DEADLINE;

    devtools.wait_for(
        "document.body && document.body.dataset.state === 'open'",
        "connected",
        deadline,
    );
    while !hub.subs.lock().unwrap().contains_key("demo") {
        assert!(
            Instant::now() < deadline,
            "the page never subscribed to demo"
        );
        thread::sleep(Duration::from_millis(50));
    }

    // Another client publishes; the page shows it.
    let (mut publisher, _) = tungstenite::connect(format!("ws://127.0.0.1:{port}/")).unwrap();
    let message =
        json!({ "type": "price", "stream": "demo", "price": 42000, "note": "from another client" });
    let publish = json!({ "type": "publish", "id": "p1", "message": message });
    publisher.send(Message::text(publish.to_string())).unwrap();
    devtools.wait_for(
        "document.body.dataset.received === '1'",
        "showed the published message",
        deadline,
    );
    let shown = devtools
        .eval("JSON.parse(document.querySelector('#messages li.message .data').textContent)");
    assert_eq!(shown, message);

    // The stats panel shows the hub's counters and the per-subscriber table.
    devtools.wait_for(
        "document.getElementById('stat-published').textContent === '1'",
        "showed the stats",
        deadline,
    );
    let subscribers = devtools.eval("document.getElementById('stat-subscribers').textContent");
    assert_eq!(
        subscribers,
        json!("2"),
        "the page's two subscriptions: demo and the stats stream"
    );
    let rows = devtools.eval("document.querySelectorAll('#subscribers tr').length");
    assert_eq!(rows, json!(2));

    let path = out_dir.join("page.png");
    let png = devtools.screenshot(&path);
    eprintln!("screenshot: {}", path.display());
    assert!(png.starts_with(b"\x89PNG"));

    let _ = publisher.close(None);
    hub.stop.store(true, Ordering::Relaxed);
    let _ = std::fs::remove_dir_all(&profile);
}
