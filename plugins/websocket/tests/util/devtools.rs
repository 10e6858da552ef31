//! Headless Chromium driven over the DevTools protocol (with tungstenite): launch it with the
//! flags the tests use and a fresh profile, open a page, evaluate expressions, wait for a
//! condition with a deadline, take a screenshot. Shared by the page tests of the plugin and of
//! the workspace (included there by path).
#![allow(dead_code, unreachable_pub)]

use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use tungstenite::Message;

/// A minimal DevTools protocol client over tungstenite.
pub struct DevTools {
    ws: tungstenite::WebSocket<TcpStream>,
    /// The DevTools `sessionId` of the attached page, which commands then go to.
    pub page: Option<String>,
    next_id: u64,
}

impl DevTools {
    pub fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let mut msg = json!({ "id": self.next_id, "method": method, "params": params });
        if let Some(page) = &self.page {
            msg["sessionId"] = json!(page);
        }
        self.ws.send(Message::text(msg.to_string())).unwrap();
        loop {
            let Message::Text(text) = self.ws.read().unwrap() else {
                continue;
            };
            let reply: Value = serde_json::from_str(&text).unwrap();
            if reply["id"] == json!(self.next_id) {
                assert!(reply.get("error").is_none(), "{method} failed: {reply}");
                return reply["result"].clone();
            }
        }
    }

    pub fn eval(&mut self, expression: &str) -> Value {
        let result = self.call(
            "Runtime.evaluate",
            json!({ "expression": expression, "returnByValue": true }),
        );
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` until it is true, or panics with `what` at the deadline.
    pub fn wait_for(&mut self, expression: &str, what: &str, deadline: Instant) {
        while self.eval(expression) != json!(true) {
            if Instant::now() > deadline {
                let page = self.eval("document.body.innerText");
                panic!(
                    "the page never {what}; it shows:\n{}",
                    page.as_str().unwrap_or_default()
                );
            }
            thread::sleep(Duration::from_millis(100));
        }
    }
}

pub struct Browser(Child);

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn launch_chromium(profile: &Path) -> (Browser, DevTools) {
    launch_chromium_with(profile, &[])
}

/// [`launch_chromium`] with extra command-line flags (`--ignore-certificate-errors` for a test
/// certificate).
pub fn launch_chromium_with(profile: &Path, extra: &[&str]) -> (Browser, DevTools) {
    let child = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--window-size=1280,800",
            "--remote-debugging-port=0",
            "about:blank",
        ])
        .args(extra)
        .arg(format!("--user-data-dir={}", profile.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("chromium is on the PATH (scripts/install-test-deps.sh installs it)");
    let browser = Browser(child);
    let port_file = profile.join("DevToolsActivePort");
    let deadline = Instant::now() + Duration::from_secs(30);
    let endpoint = loop {
        if let Ok(text) = std::fs::read_to_string(&port_file) {
            let mut lines = text.lines();
            if let (Some(port), Some(path)) = (lines.next(), lines.next()) {
                break format!("ws://127.0.0.1:{port}{path}");
            }
        }
        assert!(
            Instant::now() < deadline,
            "chromium did not open its DevTools port"
        );
        thread::sleep(Duration::from_millis(50));
    };
    let (ws, _) = tungstenite::connect(endpoint).unwrap();
    (
        browser,
        DevTools {
            ws: into_plain(ws),
            page: None,
            next_id: 0,
        },
    )
}

fn into_plain(
    ws: tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<TcpStream>>,
) -> tungstenite::WebSocket<TcpStream> {
    let tungstenite::stream::MaybeTlsStream::Plain(stream) = ws.into_inner() else {
        unreachable!("loopback DevTools is plain TCP")
    };
    tungstenite::WebSocket::from_raw_socket(stream, tungstenite::protocol::Role::Client, None)
}

impl DevTools {
    /// Opens `url` in a new tab and sends later commands to it.
    pub fn open(&mut self, url: &str) {
        let target = self.call("Target.createTarget", json!({ "url": url }));
        let attached = self.call(
            "Target.attachToTarget",
            json!({ "targetId": target["targetId"], "flatten": true }),
        );
        self.page = Some(
            attached["sessionId"]
                .as_str()
                .expect("a sessionId")
                .to_owned(),
        );
    }

    /// A PNG screenshot of the page, written to `path`.
    pub fn screenshot(&mut self, path: &Path) -> Vec<u8> {
        let shot = self.call("Page.captureScreenshot", json!({ "format": "png" }));
        let png = base64::engine::general_purpose::STANDARD
            .decode(shot["data"].as_str().expect("image data"))
            .expect("base64 image");
        std::fs::write(path, &png).expect("screenshot written");
        png
    }
}
