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

#[test]
fn a_connection_close_is_one_log_line_with_its_reason_and_counts() {
    let log = Captured::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
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
