//! End to end: a graceful shutdown (SIGTERM to `powerhub serve`) loses nothing the server
//! accepted. The server stops accepting, keeps reading and serving what its connections already
//! sent until each has gone quiet (or `engine.shutdown_timeout_ms` passes), delivers it, then
//! closes every connection with the `shutdown` error. Runs on both backends.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Bound on every wait (a healthy run takes well under a second).
const WAIT: Duration = Duration::from_secs(30);

const MESSAGES: u64 = 10_000;

/// The server process, killed if a test fails before it exits.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `powerhub serve` with one NDJSON listener; returns it, its address and its backend.
fn spawn(backend: &str) -> (Server, String, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_powerhub"))
        .args(["serve", "--shards", "2", "--backend", backend])
        .args(["--listen", "ndjson=127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("powerhub starts");
    let mut server = Server(child);
    let mut out = BufReader::new(server.0.stdout.take().unwrap());
    let (mut addr, mut name) = (String::new(), String::new());
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "exited before ready");
        if let Some(a) = line.strip_prefix("listening ndjson ") {
            addr = a.trim().to_owned();
        }
        if let Some(b) = line.strip_prefix("backend ") {
            name = b.trim().to_owned();
        }
        if line.trim() == "ready" {
            return (server, addr, name);
        }
    }
}

/// Every line the server sends on `s` until it closes, parsed, keepalive pings left out.
fn lines_until_close(s: TcpStream) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for line in BufReader::new(s).lines() {
        let Ok(line) = line else { break };
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        if v["type"] != "ping" {
            out.push(v);
        }
    }
    out
}

fn run(backend: &str) {
    let (mut server, addr, name) = spawn(backend);
    if name != backend {
        eprintln!("notice: {backend} is not available here (runs {name}); skipped");
        return;
    }
    let connect = || {
        let s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s
    };
    let mut sub = connect();
    sub.write_all(b"{\"type\":\"subscribe\",\"id\":\"s\",\"stream\":\"last\"}\n")
        .unwrap();
    let mut sub_reader = BufReader::new(sub.try_clone().unwrap());
    let mut line = String::new();
    sub_reader.read_line(&mut line).unwrap();
    assert!(line.contains("\"subscribed\""), "{line}");
    let subscriber = std::thread::spawn(move || {
        let mut out = Vec::new();
        for line in sub_reader.lines() {
            let Ok(line) = line else { break };
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            if v["type"] != "ping" {
                out.push(v);
            }
        }
        out
    });

    let mut publisher = connect();
    let answers = {
        let s = publisher.try_clone().unwrap();
        std::thread::spawn(move || lines_until_close(s))
    };
    let mut burst = String::new();
    for i in 0..MESSAGES {
        burst.push_str(&format!(
            "{{\"type\":\"publish\",\"id\":{i},\"message\":{{\"type\":\"tick\",\"stream\":\"last\",\"seq\":{i}}}}}\n"
        ));
    }
    publisher.write_all(burst.as_bytes()).unwrap();
    // SIGTERM at once: much of the burst is still unread in the server's socket buffer.
    let pid = server.0.id() as libc::pid_t;
    // SAFETY: kill(2) with the child's pid and a valid signal number; it touches no memory.
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(sent, 0, "SIGTERM sent");

    let answers = answers.join().unwrap();
    let delivered = subscriber.join().unwrap();
    let deadline = Instant::now() + WAIT;
    let status = loop {
        if let Some(s) = server.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "powerhub did not exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(status.success(), "{status}");

    // The publisher gave ids: an answer for each, in order, then the shutdown error.
    let (last, replies) = answers.split_last().expect("answers");
    assert_eq!(last["code"], "shutdown", "{last}");
    assert_eq!(
        replies.len() as u64,
        MESSAGES,
        "an answer for every publish ({backend})"
    );
    for (i, r) in replies.iter().enumerate() {
        assert_eq!(r["type"], "published", "{r}");
        assert_eq!(r["requestId"], i as u64, "{r}");
    }
    // The subscriber got every message the server read (all of them: the publisher stopped
    // writing before the signal), in order, then the shutdown error.
    let (last, ticks) = delivered.split_last().expect("deliveries");
    assert_eq!(last["code"], "shutdown", "{last}");
    assert_eq!(
        ticks.len() as u64,
        MESSAGES,
        "every message delivered ({backend})"
    );
    for (i, m) in ticks.iter().enumerate() {
        assert_eq!(m["seq"], i as u64, "{m}");
    }
}

#[test]
fn a_graceful_shutdown_delivers_every_message_read_and_answers_every_publish_on_io_uring() {
    if std::env::var("POWERHUB_BACKEND").is_ok_and(|v| v == "epoll") {
        eprintln!("notice: POWERHUB_BACKEND=epoll; the io_uring run is skipped");
        return;
    }
    run("io_uring");
}

#[test]
fn a_graceful_shutdown_delivers_every_message_read_and_answers_every_publish_on_epoll() {
    run("epoll");
}
