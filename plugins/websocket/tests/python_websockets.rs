//! Cross-check against Python `websockets`: the workspace's `tests/websocket_client.py` in its
//! `echo` mode talks to the codec driven by the echo loop over loopback TCP (handshake, text and
//! binary, fragmented messages, ping/pong both ways, the close handshake from either side, bad
//! frames closed with 1002, 1007 and 1009).
//!
//! Needs `python3` with `websockets` (the test dependency script installs it); set
//! `POWERHUB_SKIP_PYTHON=1` to skip where it cannot be installed.

mod util;

use std::path::PathBuf;
use std::process::Command;

use powerhub_websocket::WebSocketConfig;
use util::EchoServer;

#[test]
fn python_websockets_client_passes_every_echo_check() {
    if std::env::var_os("POWERHUB_SKIP_PYTHON").is_some() {
        eprintln!("POWERHUB_SKIP_PYTHON is set: the Python client test is skipped");
        return;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/websocket_client.py");
    // Small reads, so that messages reach the codec in pieces.
    let server = EchoServer::start(WebSocketConfig::default(), 1000);
    let output = Command::new("python3")
        .arg(&script)
        .args([
            "--mode",
            "echo",
            &format!("ws://127.0.0.1:{}/", server.port),
        ])
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
