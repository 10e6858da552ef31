//! A connection's close is one log line with its reason and counts, on both backends; it is not
//! one line per subscription. (A test binary of its own: it installs the process's global
//! `tracing` subscriber to read the lines the shards write.)

mod engine_support;

use std::io::Write;
use std::sync::{Arc, Mutex};

use engine_support::*;

/// Everything logged, as text.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn take(&self) -> String {
        String::from_utf8(std::mem::take(&mut *self.0.lock().unwrap())).unwrap()
    }
}

/// The process's log, captured once for every test here, and a lock that runs the tests one
/// at a time (each reads the lines of its own connections).
fn captured_log() -> (Captured, std::sync::MutexGuard<'static, ()>) {
    static LOG: std::sync::OnceLock<Captured> = std::sync::OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let log = LOG.get_or_init(|| {
        let log = Captured::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        log
    });
    (log.clone(), guard)
}

/// The first `connection closed` line of the log `text`.
fn close_line(text: &str) -> &str {
    text.lines()
        .find(|l| l.contains("connection closed"))
        .unwrap_or_else(|| panic!("a close line:\n{text}"))
}

#[test]
fn a_connection_close_is_one_log_line_with_its_reason_and_counts() {
    let (log, _one_at_a_time) = captured_log();
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        // A small mark, so that the subscriptions' sends are pending when the client goes.
        config.limits.backpressure_bytes = 64 << 10;
        config.limits.max_outbox_bytes = 256 << 20;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        for i in 0..256 {
            c.send(&format!(
                r#"{{"type":"subscribe","id":{i},"stream":"wide"}}"#
            ));
        }
        for _ in 0..256 {
            assert_eq!(c.msg()["type"], "subscribed");
        }
        // Each message goes to all 256 subscriptions: far more than the client reads.
        for seq in 0..64 {
            publish(&server.engine, "wide", seq, 1024);
        }
        eventually("the subscriptions are back-pressured", || {
            server.engine.stats().unsent_bytes > 64 << 10
        });
        log.take();
        drop(c);
        eventually("the connection is closed", || {
            server.engine.stats().open_connections == 0
        });
        server.engine.shutdown().unwrap();
        let text = log.take();
        let closes: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("connection closed"))
            .collect();
        assert_eq!(closes.len(), 1, "one line for the one connection:\n{text}");
        let line = closes[0];
        for field in [
            "reason=",
            "protocol=\"ndjson\"",
            "bytes_in=",
            "bytes_out=",
            "messages_in=256",
            "deliveries=",
            "subscriptions=256",
            "duration_ms=",
        ] {
            assert!(line.contains(field), "{field} in {line}");
        }
        assert!(
            !text.contains("WARN"),
            "no warning per subscription when a connection goes:\n{text}"
        );
    });
}

#[test]
fn a_close_the_server_decides_is_logged_at_info_even_when_it_cannot_be_said() {
    let (log, _one_at_a_time) = captured_log();
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.outbox.keepalive_interval_ms = 50;
        config.outbox.liveness_timeout_ms = 300;
        config.limits.max_outbox_bytes = 256 << 20;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        c.send(r#"{"type":"subscribe","id":1,"stream":"deep"}"#);
        assert_eq!(c.msg()["type"], "subscribed");
        log.take();
        // Far more than the loopback socket holds; the client reads none of it and answers no
        // ping, so the server reaps it with half a message written: nothing can be said.
        for seq in 0..400 {
            publish(&server.engine, "deep", seq, 64 << 10);
        }
        eventually("the stalled connection is reaped", || {
            server.engine.stats().open_connections == 0
        });
        server.engine.shutdown().unwrap();
        let text = log.take();
        let line = close_line(&text);
        assert!(line.contains("liveness_timeout_ms"), "{line}");
        assert!(line.contains("INFO"), "logged at info: {line}");
        drop(c);
    });
}

/// The close line's `bytes_out` counts everything the connection was sent: a connection whose
/// only output is the final error of a line over `max_message_bytes` logs that error's bytes.
#[test]
fn a_close_line_counts_the_final_error_in_bytes_out() {
    let (log, _one_at_a_time) = captured_log();
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_message_bytes = 1024;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        log.take();
        c.send_raw(&[b'x'; 4096]);
        let error = c.line().expect("the final error");
        assert!(c.line().is_none(), "closed after the error");
        eventually("the connection is closed", || {
            server.engine.stats().open_connections == 0
        });
        server.engine.shutdown().unwrap();
        let text = log.take();
        let line = close_line(&text);
        let said = format!("bytes_out={}", error.len() + 1);
        assert!(line.contains(&said), "{said} in {line}");
    });
}
