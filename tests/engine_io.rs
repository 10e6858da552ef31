//! The engine over real loopback sockets, on both IO backends.

mod engine_support;

use engine_support::*;

#[test]
fn ping_gets_pong_on_both_backends() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        for _ in 0..3 {
            c.send(r#"{"type":"ping"}"#);
            assert_eq!(c.json()["type"], "pong");
        }
        server.engine.shutdown().unwrap();
    });
}

#[test]
fn malformed_input_gets_an_error_and_the_connection_survives() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        c.send("{not json");
        let e = c.json();
        assert_eq!(e["type"], "error", "{e}");
        c.send_raw(b"\xff\xfe\n");
        assert_eq!(c.json()["type"], "error");
        c.send(r#"{"type":"ping"}"#);
        assert_eq!(c.json()["type"], "pong");
    });
}

#[test]
fn line_over_max_message_bytes_gets_an_error_naming_the_limit_then_close() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_message_bytes = 128;
        let server = start(config);
        let mut other = Client::connect(server.addr);
        let mut c = Client::connect(server.addr);
        c.send(&format!(
            "{{\"type\":\"ping\",\"pad\":\"{}\"}}",
            "x".repeat(200)
        ));
        let e = c.json();
        assert_eq!(e["type"], "error", "{e}");
        assert!(e.to_string().contains("max_message_bytes"), "{e}");
        assert!(c.line().is_none(), "closed after the error");
        other.send(r#"{"type":"ping"}"#);
        assert_eq!(other.json()["type"], "pong", "other clients carry on");
        eventually("the limit is counted", || {
            server.engine.stats().limit_errors >= 1
        });
    });
}

/// The commands before a line over `max_message_bytes` in the same write are answered before
/// its error, as they would be had the line come in a later write: a publisher learns which of
/// its publishes happened.
#[test]
fn commands_before_a_line_over_max_message_bytes_in_one_write_are_answered_before_its_error() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_message_bytes = 256;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        let mut write = String::new();
        for n in 0..3 {
            write.push_str(&format!(
                "{{\"type\":\"publish\",\"id\":{n},\"message\":{{\"type\":\"t\",\"stream\":\"s\"}}}}\n"
            ));
        }
        write.push_str("{\"type\":\"ping\",\"id\":\"p\"}\n");
        write.push_str(&format!(
            "{{\"type\":\"ping\",\"pad\":\"{}\"}}\n",
            "x".repeat(400)
        ));
        c.send_raw(write.as_bytes());
        for n in 0..3 {
            let r = c.json();
            assert_eq!(
                (r["type"].as_str(), r["requestId"].as_i64()),
                (Some("published"), Some(n)),
                "{r}"
            );
        }
        let pong = c.json();
        assert_eq!(
            (pong["type"].as_str(), pong["requestId"].as_str()),
            (Some("pong"), Some("p")),
            "{pong}"
        );
        let e = c.json();
        assert_eq!(e["code"], "limit_exceeded", "{e}");
        assert_eq!(e["limit"], "max_message_bytes", "{e}");
        assert!(c.line().is_none(), "closed after the error");
    });
}

/// A subscriber that publishes to its own stream, then sends a line over `max_message_bytes`
/// in the same write, gets its delivery (and, with an id, the reply counting it) before the
/// final error: the fan-out of its last publish goes before the close, with or without an id.
#[test]
fn a_subscribers_own_publish_before_a_line_over_max_message_bytes_is_delivered_before_its_error() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_message_bytes = 256;
        let server = start(config);
        for id in ["", r#","id":"own""#] {
            let mut c = Client::connect(server.addr);
            c.subscribe("s");
            let write = format!(
                "{{\"type\":\"publish\"{id},\"message\":{{\"type\":\"t\",\"stream\":\"s\",\"n\":1}}}}\n{}\n",
                "x".repeat(400)
            );
            c.send_raw(write.as_bytes());
            let mut got = Vec::new();
            while let Some(line) = c.line() {
                let v: serde_json::Value = serde_json::from_str(&line).unwrap();
                if v["type"] != "ping" {
                    got.push(v["type"].as_str().unwrap_or_default().to_owned());
                }
            }
            let mut expected = vec!["t"];
            if !id.is_empty() {
                expected.insert(0, "published");
            }
            expected.push("error");
            assert_eq!(got, expected, "id {id:?}");
        }
    });
}

#[test]
fn max_connections_refuses_the_next_client_with_an_error_naming_the_limit() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_connections = 2;
        let server = start(config);
        let mut a = Client::connect(server.addr);
        let mut b = Client::connect(server.addr);
        a.send(r#"{"type":"ping"}"#);
        assert_eq!(a.json()["type"], "pong");
        b.send(r#"{"type":"ping"}"#);
        assert_eq!(b.json()["type"], "pong");
        let mut c = Client::connect(server.addr);
        let e = c.json();
        assert_eq!(e["type"], "error");
        assert_eq!(e["limit"], "max_connections", "{e}");
        assert!(c.line().is_none());
        a.send(r#"{"type":"ping"}"#);
        assert_eq!(a.json()["type"], "pong");
        eventually("rejection counted", || server.engine.stats().rejected == 1);
        drop(a);
        eventually("a slot is free again", || {
            server.engine.stats().open_connections == 1
        });
        let mut d = Client::connect(server.addr);
        d.send(r#"{"type":"ping"}"#);
        assert_eq!(d.json()["type"], "pong");
    });
}

#[test]
fn peer_half_close_gets_the_queued_replies_then_a_close() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        for _ in 0..100 {
            c.send(r#"{"type":"ping"}"#);
        }
        c.writer.shutdown(std::net::Shutdown::Write).unwrap();
        let rest = c.rest();
        let text = String::from_utf8(rest).unwrap();
        assert_eq!(text.lines().count(), 100, "{text}");
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["type"], "pong", "{line}");
        }
        eventually("connection released", || {
            server.engine.stats().open_connections == 0
        });
    });
}

/// The peer closed first, so the server closes without a half-close or a linger: what the
/// kernel still holds of the replies (far more than one socket buffer here) must reach the
/// client before the end of stream, never a reset.
#[test]
fn peer_close_after_a_large_reply_backlog_still_gets_every_reply() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        let pings = 40_000;
        c.send_raw("{\"type\":\"ping\"}\n".repeat(pings).as_bytes());
        c.writer.shutdown(std::net::Shutdown::Write).unwrap();
        let text = String::from_utf8(c.rest()).unwrap();
        assert_eq!(text.lines().count(), pings);
        assert!(text.lines().all(|l| l.contains(r#""type":"pong""#)));
        eventually("connection released", || {
            server.engine.stats().open_connections == 0
        });
    });
}

#[test]
fn idle_connection_is_closed_after_idle_timeout_with_an_error() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.idle_timeout_ms = 100;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        let e = c.json();
        assert_eq!(e["limit"], "idle_timeout_ms", "{e}");
        assert!(c.line().is_none());
    });
}

#[test]
fn client_that_never_reads_its_replies_is_closed_at_max_outbox_bytes() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.backpressure_bytes = 16 << 10;
        config.limits.max_outbox_bytes = 256 << 10;
        let server = start(config);
        let mut other = Client::connect(server.addr);
        // Greeted, so that its first-message timeout is no limit error of the test's.
        other.send(r#"{"type":"ping"}"#);
        assert_eq!(other.json()["type"], "pong");
        let mut c = Client::connect(server.addr);
        // 20 000 pings whose ids make each pong ~1 KiB: ~20 MiB of replies, never read while
        // sending, far beyond the socket buffers and the outbox limit.
        let id = "i".repeat(1000);
        let writer = {
            let mut w = c.writer.try_clone().unwrap();
            std::thread::spawn(move || {
                use std::io::Write;
                let line = format!("{{\"type\":\"ping\",\"id\":\"{id}\"}}\n");
                for _ in 0..20_000 {
                    if w.write_all(line.as_bytes()).is_err() {
                        break; // the server closed the connection
                    }
                }
            })
        };
        // Held back `push::INPUT_WAIT` after its socket stopped taking replies, then closed at
        // the limit: more than `eventually`'s wait, with the buffers' filling first.
        let deadline = std::time::Instant::now() + powerhub::push::INPUT_WAIT * 4;
        while server.engine.stats().limit_errors < 1 {
            assert!(std::time::Instant::now() < deadline, "the limit is hit");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let rest = String::from_utf8_lossy(&c.rest()).into_owned();
        assert!(
            rest.contains("\"limit\":\"max_outbox_bytes\""),
            "the client is told which limit ({} bytes read)",
            rest.len()
        );
        writer.join().unwrap();
        other.send(r#"{"type":"ping"}"#);
        assert_eq!(other.msg()["type"], "pong", "other clients carry on");
    });
}

#[test]
fn counters_are_published_to_the_stats_stream_while_it_has_subscribers() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.engine.stats_interval_ms = 20;
        let server = start(config);
        let mut c = Client::connect(server.addr);
        c.subscribe(powerhub::runtime::STATS_STREAM);
        // Members in the order docs/websocket.md shows.
        let line = loop {
            let line = c.line().expect("a stats message");
            if !line.contains(r#""type":"ping""#) {
                break line;
            }
        };
        assert!(
            line.starts_with(r#"{"type":"stats","stream":"$stats","stats":{"subscribers":1,"#),
            "{line}"
        );
        assert!(line.contains(r#""list":[{"id":"#), "{line}");
        assert!(line.contains(r#""engine":{"backend":"#), "{line}");
        let m: serde_json::Value = serde_json::from_str(&line).expect("JSON");
        assert_eq!(m["type"], "stats", "{m}");
        assert_eq!(m["stats"]["subscribers"], 1, "{m}");
        assert_eq!(m["stats"]["engine"]["open_connections"], 1, "{m}");
        let name = server.engine.backend().as_str();
        assert_eq!(m["stats"]["engine"]["backend"], name, "{m}");
        // Each shard's share: the one subscription is on one of the two shards.
        let shards = m["stats"]["engine"]["shards"].as_array().expect("shards");
        assert_eq!(shards.len(), 2, "{m}");
        let subs: Vec<_> = shards.iter().map(|s| &s["subscriptions"]).collect();
        assert!(subs == [1, 0] || subs == [0, 1], "{m}");
        let row = &m["stats"]["list"][0];
        assert_eq!(row["topic"], "$stats", "{m}");
        assert_eq!(row["in_flight"], false, "{m}");

        // Past `STATS_LIST_MAX` subscribers the list stops, and `subscribers` counts them all.
        let max = powerhub::runtime::STATS_LIST_MAX;
        // Sent without waiting for each answer: stats messages come in between.
        for i in 0..max {
            c.send(&format!(
                r#"{{"type":"subscribe","id":{i},"stream":"t{i}"}}"#
            ));
        }
        let m = loop {
            let line = c.line().expect("a stats message");
            let m: serde_json::Value = serde_json::from_str(&line).expect("JSON");
            if m["type"] == "stats" && m["stats"]["subscribers"] == max + 1 {
                break m;
            }
        };
        assert_eq!(m["stats"]["list"].as_array().unwrap().len(), max, "{m}");
    });
}

#[test]
fn unix_listener_replaces_a_stale_socket_file_and_refuses_a_live_one() {
    use powerhub::runtime::{Engine, EngineError, ListenerConfig, ProtocolRegistry};
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::{UnixListener, UnixStream};

    on_both_backends(|backend| {
        let dir =
            std::env::temp_dir().join(format!("powerhub-unix-{}-{backend:?}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("push.sock");
        drop(UnixListener::bind(&path).unwrap()); // leaves a stale socket file behind
        assert!(path.exists());
        let mut config = base_config(backend);
        config.listeners = vec![ListenerConfig::unix("ndjson", &path)];
        let engine = Engine::start(config.clone(), &ProtocolRegistry::with_builtins())
            .expect("stale file replaced");
        let mut s = UnixStream::connect(&path).unwrap();
        s.set_read_timeout(Some(WAIT)).unwrap();
        s.write_all(b"{\"type\":\"ping\",\"id\":1}\n").unwrap();
        let mut line = String::new();
        BufReader::new(s.try_clone().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("\"pong\""), "{line}");
        // A second engine on the same path finds it in use and says which listener.
        let err = Engine::start(config, &ProtocolRegistry::with_builtins()).unwrap_err();
        assert!(matches!(err, EngineError::Bind { index: 0, .. }), "{err}");
        assert!(err.to_string().contains("push.sock"), "{err}");
        engine.shutdown().unwrap();
        assert!(!path.exists(), "the socket file is removed at shutdown");
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Holds a shard: its connection's `decode` blocks on a `STALL` line until the gate opens.
#[derive(Debug, Default)]
struct Gate {
    /// (a decode is blocked, the gate is open)
    state: std::sync::Mutex<(bool, bool)>,
    changed: std::sync::Condvar,
}

impl Gate {
    fn wait_open(&self) {
        let mut s = self.state.lock().unwrap();
        s.0 = true;
        self.changed.notify_all();
        while !s.1 {
            s = self.changed.wait(s).unwrap();
        }
    }

    fn wait_blocked(&self) {
        let s = self.state.lock().unwrap();
        let (_s, timeout) = self.changed.wait_timeout_while(s, WAIT, |s| !s.0).unwrap();
        assert!(!timeout.timed_out(), "the STALL line never reached decode");
    }

    fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.changed.notify_all();
    }
}

/// NDJSON, except that a `STALL` line blocks the owning shard in `decode` until the gate opens,
/// and a `PANIC` line panics there.
#[derive(Debug)]
struct Stall(std::sync::Arc<Gate>);

impl powerhub::plugin::StreamProtocol for Stall {
    fn decode(
        &mut self,
        input: &mut powerhub::plugin::BytesMut,
        out: &mut powerhub::plugin::ProtocolOutput,
    ) -> Result<(), powerhub::plugin::ProtocolError> {
        while let Some(pos) = input.iter().position(|&b| b == b'\n') {
            let line = input.split_to(pos + 1).freeze().slice(..pos);
            if &line[..] == b"STALL" {
                self.0.wait_open();
            } else if &line[..] == b"PANIC" {
                panic!("a transport plugin's bug");
            } else {
                out.events.push(powerhub::plugin::Inbound::Text(line));
            }
        }
        Ok(())
    }

    fn encode_text(&mut self, json: &[u8], out: &mut powerhub::plugin::BytesMut) {
        out.extend_from_slice(json);
        out.extend_from_slice(b"\n");
    }

    fn is_ready(&self) -> bool {
        true
    }

    fn name(&self) -> &str {
        "stall"
    }
}

#[derive(Debug)]
struct StallFactory(std::sync::Arc<Gate>);

impl powerhub::plugin::ProtocolFactory for StallFactory {
    fn name(&self) -> &str {
        "stall"
    }

    fn new_connection(
        &self,
        _limits: &powerhub::plugin::ProtocolLimits,
    ) -> Box<dyn powerhub::plugin::StreamProtocol> {
        Box::new(Stall(std::sync::Arc::clone(&self.0)))
    }
}

/// No shard is special: every shard accepts on every listener. With the first connection's
/// shard (shard 0, the first in the round-robin) held inside a decode, a new connection is
/// still accepted by the other shard and served.
#[test]
fn every_shard_accepts_so_a_busy_shard_holds_up_no_new_connection() {
    on_both_backends(|backend| {
        let gate = std::sync::Arc::new(Gate::default());
        let mut config = base_config(backend);
        assert_eq!(config.engine.shards, 2);
        config.listeners = vec![powerhub::runtime::ListenerConfig::tcp(
            "stall",
            "127.0.0.1:0",
        )];
        let mut registry = powerhub::runtime::ProtocolRegistry::with_builtins();
        registry
            .register(std::sync::Arc::new(StallFactory(std::sync::Arc::clone(
                &gate,
            ))))
            .unwrap();
        let server = start_with(config, &registry);
        let mut first = Client::connect(server.addr);
        first.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(first.json()["type"], "pong");
        first.send("STALL");
        gate.wait_blocked();
        let mut second = Client::connect(server.addr);
        second
            .writer
            .set_read_timeout(Some(std::time::Duration::from_secs(3)))
            .unwrap();
        second.send(r#"{"type":"ping","id":2}"#);
        let mut reply = String::new();
        let read = std::io::BufRead::read_line(&mut second.reader, &mut reply);
        // The held shard goes on before any assertion, so that a failure still shuts down.
        gate.open();
        assert!(
            read.as_ref().is_ok_and(|&n| n > 0) && reply.contains("\"pong\""),
            "a new connection waited for the busy shard: {read:?} {reply:?}"
        );
        first.send(r#"{"type":"ping","id":3}"#);
        assert_eq!(first.json()["requestId"], 3);
        server.engine.shutdown().unwrap();
    });
}

/// A panic while handling one connection's input (here a transport plugin's `decode`) closes
/// that connection with `internal_error`, said in its protocol; the shard's other connections and
/// the server go on.
#[test]
fn a_panic_handling_one_connection_closes_it_with_internal_error_and_the_shard_goes_on() {
    on_both_backends(|backend| {
        let gate = std::sync::Arc::new(Gate::default());
        let mut config = base_config(backend);
        config.listeners = vec![powerhub::runtime::ListenerConfig::tcp(
            "stall",
            "127.0.0.1:0",
        )];
        let mut registry = powerhub::runtime::ProtocolRegistry::with_builtins();
        registry
            .register(std::sync::Arc::new(StallFactory(gate)))
            .unwrap();
        let server = start_with(config, &registry);
        // Round-robin over two shards: the first and third connections share shard 0.
        let mut clients: Vec<Client> = (0..3).map(|_| Client::connect(server.addr)).collect();
        for (i, c) in clients.iter_mut().enumerate() {
            c.send(&format!(r#"{{"type":"ping","id":{i}}}"#));
            assert_eq!(c.json()["requestId"], i);
        }
        clients[0].send("PANIC");
        let error = clients[0].json();
        assert_eq!(error["type"], "error");
        assert_eq!(error["code"], "internal_error");
        assert_eq!(clients[0].line(), None, "then the connection closes");
        for (i, c) in clients.iter_mut().enumerate().skip(1) {
            c.send(&format!(r#"{{"type":"ping","id":{}}}"#, 10 + i));
            assert_eq!(c.json()["requestId"], 10 + i, "connection {i} goes on");
        }
        let mut late = Client::connect(server.addr);
        late.send(r#"{"type":"ping","id":99}"#);
        assert_eq!(late.json()["requestId"], 99);
        server.engine.shutdown().unwrap();
    });
}

/// A transport plugin that makes NDJSON connections, and panics making the next one once told.
#[derive(Debug, Default)]
struct Flaky {
    panic_next: std::sync::atomic::AtomicBool,
}

impl powerhub::plugin::ProtocolFactory for Flaky {
    fn name(&self) -> &str {
        "flaky"
    }

    fn new_connection(
        &self,
        limits: &powerhub::plugin::ProtocolLimits,
    ) -> Box<dyn powerhub::plugin::StreamProtocol> {
        use std::sync::atomic::Ordering;
        assert!(
            !self.panic_next.swap(false, Ordering::Relaxed),
            "a plugin bug making a connection"
        );
        powerhub::plugin::ProtocolFactory::new_connection(&powerhub_ndjson::NdjsonFactory, limits)
    }
}

/// A transport plugin that panics making a connection (`ProtocolFactory::new_connection`, before
/// any protocol exists to say so) loses that connection, closed at once; the shard, its other
/// connections and the connections after go on.
#[test]
fn a_plugin_that_panics_making_a_connection_loses_that_connection_not_the_server() {
    on_both_backends(|backend| {
        let flaky = std::sync::Arc::new(Flaky::default());
        let mut config = base_config(backend);
        config.listeners = vec![powerhub::runtime::ListenerConfig::tcp(
            "flaky",
            "127.0.0.1:0",
        )];
        let mut registry = powerhub::runtime::ProtocolRegistry::with_builtins();
        registry
            .register(std::sync::Arc::clone(&flaky) as _)
            .unwrap();
        let server = start_with(config, &registry);
        let mut first = Client::connect(server.addr);
        first.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(first.json()["requestId"], 1);
        flaky
            .panic_next
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let mut doomed = Client::connect(server.addr);
        assert_eq!(doomed.line(), None, "closed at once");
        first.send(r#"{"type":"ping","id":2}"#);
        assert_eq!(first.json()["requestId"], 2, "the others go on");
        let mut late = Client::connect(server.addr);
        late.send(r#"{"type":"ping","id":3}"#);
        assert_eq!(
            late.json()["requestId"],
            3,
            "and new connections are served"
        );
        server.engine.shutdown().unwrap();
    });
}

/// A subscriber that keeps up is not closed for one message larger than
/// `limits.max_outbox_bytes`: its socket takes what it can and the rest follows as it reads
/// (the limit is for a reader that falls behind: one whose socket refused part of a write and
/// that is sent more).
#[test]
fn a_reader_that_keeps_up_gets_messages_larger_than_max_outbox_bytes() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.backpressure_bytes = 16 << 10;
        config.limits.max_outbox_bytes = 64 << 10;
        let server = start(config);
        let mut reader = Client::connect(server.addr);
        reader.subscribe("big");
        let mut publisher = Client::connect(server.addr);
        for seq in 0..20 {
            publisher.send(&format!(
                r#"{{"type":"publish","id":{seq},"message":{}}}"#,
                message("big", seq, 70_000)
            ));
            let ack = publisher.msg();
            assert_eq!(ack["delivered"], 1, "{ack}");
            let got = reader.msg();
            assert_eq!(got["seq"], seq, "{backend:?}: {}", got["type"]);
            assert_eq!(got["pad"].as_str().map(str::len), Some(70_000));
        }
        assert_eq!(server.engine.stats().limit_errors, 0);
        server.engine.shutdown().unwrap();
    });
}

/// `EngineStats::limit_errors` counts a limit error that leaves the connection open: a line
/// nested deeper than `max_json_depth` gets an error naming the limit, the connection goes on, and
/// the error is counted.
#[test]
fn a_line_nested_past_max_json_depth_is_answered_counted_and_the_connection_goes_on() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        c.send(&format!(
            r#"{{"type":"ping","id":4,"x":{}{}}}"#,
            "[".repeat(200),
            "]".repeat(200)
        ));
        let e = c.json();
        assert_eq!(
            (&e["code"], &e["limit"], &e["requestId"]),
            (
                &"limit_exceeded".into(),
                &"max_json_depth".into(),
                &4.into()
            ),
            "{e}"
        );
        c.send(r#"{"type":"ping","id":5}"#);
        assert_eq!(c.json()["requestId"], 5);
        eventually("the limit error is counted", || {
            server.engine.stats().limit_errors >= 1
        });
        server.engine.shutdown().unwrap();
    });
}
