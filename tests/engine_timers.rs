//! Handshake deadline, keepalive and liveness reaping over real sockets, on both backends.

mod engine_support;

use std::io::Write;
use std::sync::Arc;

use engine_support::*;
use powerhub::plugin::{
    BytesMut, Inbound, ProtocolError, ProtocolFactory, ProtocolLimits, ProtocolOutput,
    StreamProtocol,
};
use powerhub::runtime::{ListenerConfig, ProtocolRegistry};

/// NDJSON after a `HELLO` line (answered `WELCOME`): a protocol with an opening handshake.
#[derive(Debug, Default)]
struct Hello {
    ready: bool,
}

impl StreamProtocol for Hello {
    fn decode(
        &mut self,
        input: &mut BytesMut,
        out: &mut ProtocolOutput,
    ) -> Result<(), ProtocolError> {
        while let Some(pos) = input.iter().position(|&b| b == b'\n') {
            let line = input.split_to(pos + 1).freeze().slice(..pos);
            if self.ready {
                out.events.push(Inbound::Text(line));
            } else if &line[..] == b"HELLO" {
                self.ready = true;
                out.urgent.extend_from_slice(b"WELCOME\n");
            } else {
                return Err(ProtocolError::Handshake("expected HELLO".into()));
            }
        }
        Ok(())
    }

    fn encode_text(&mut self, json: &[u8], out: &mut BytesMut) {
        out.extend_from_slice(json);
        out.extend_from_slice(b"\n");
    }

    fn is_ready(&self) -> bool {
        self.ready
    }

    fn name(&self) -> &str {
        "hello"
    }
}

#[derive(Debug)]
struct HelloFactory;

impl ProtocolFactory for HelloFactory {
    fn name(&self) -> &str {
        "hello"
    }

    fn new_connection(&self, _limits: &ProtocolLimits) -> Box<dyn StreamProtocol> {
        Box::new(Hello::default())
    }
}

#[test]
fn handshake_timeout_closes_a_client_that_never_completes_its_handshake() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.listeners = vec![ListenerConfig::tcp("hello", "127.0.0.1:0")];
        config.limits.first_message_timeout_ms = 100;
        let mut registry = ProtocolRegistry::with_builtins();
        registry.register(Arc::new(HelloFactory)).unwrap();
        let server = start_with(config, &registry);
        let mut silent = Client::connect(server.addr);
        let mut polite = Client::connect(server.addr);
        polite.send("HELLO");
        assert_eq!(polite.line().as_deref(), Some("WELCOME"));
        // Its first message within the deadline (limits.first_message_timeout_ms covers the
        // first complete message after the handshake too).
        polite.send(r#"{"type":"ping","id":0}"#);
        assert_eq!(polite.msg()["type"], "pong");
        assert!(
            silent.line().is_none(),
            "no handshake within handshake_timeout_ms: closed"
        );
        polite.send(r#"{"type":"ping","id":1}"#);
        assert_eq!(
            polite.msg()["type"],
            "pong",
            "the client that completed its handshake carries on"
        );
        eventually("the timeout is counted", || {
            server.engine.stats().limit_errors >= 1
        });
    });
}

#[test]
fn replies_wait_for_the_handshake_and_urgent_bytes_go_first() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.listeners = vec![ListenerConfig::tcp("hello", "127.0.0.1:0")];
        let mut registry = ProtocolRegistry::with_builtins();
        registry.register(Arc::new(HelloFactory)).unwrap();
        let server = start_with(config, &registry);
        let mut c = Client::connect(server.addr);
        // The handshake and a command in one write: the handshake reply comes first.
        c.writer
            .write_all(b"HELLO\n{\"type\":\"ping\",\"id\":7}\n")
            .unwrap();
        assert_eq!(c.line().as_deref(), Some("WELCOME"));
        assert_eq!(c.msg()["requestId"], 7);
    });
}

#[test]
fn keepalive_pings_flow_and_a_client_that_never_answers_is_reaped() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.outbox.keepalive_interval_ms = 50;
        config.outbox.liveness_timeout_ms = 300;
        let server = start(config);
        let mut mute = Client::connect(server.addr);
        let mut alive = Client::connect(server.addr);
        // `mute` reads everything but never answers a ping: reaped after the liveness timeout.
        let mute_reader = std::thread::spawn(move || {
            let mut pings = 0;
            while let Some(line) = mute.line() {
                if line.contains("\"liveness_timeout_ms\"") {
                    continue; // the reaping is said
                }
                assert!(line.contains("\"ping\""), "{line}");
                pings += 1;
            }
            pings
        });
        // `alive` answers every ping.
        let mut pongs = 0;
        while !mute_reader.is_finished() {
            let v = alive.json();
            assert_eq!(v["type"], "ping");
            alive.send(r#"{"type":"pong"}"#);
            pongs += 1;
        }
        let pings = mute_reader.join().unwrap();
        assert!(
            pings >= 2,
            "keepalive pings reached the mute client before it was reaped ({pings})"
        );
        assert!(pongs >= 2);
        // Still served after the other was reaped.
        alive.send(r#"{"type":"ping","id":"still"}"#);
        assert_eq!(alive.msg()["requestId"], "still");
        eventually("the reaped connection is released", || {
            server.engine.stats().open_connections == 1
        });
    });
}

/// A blocking client whose receive buffer is `rcvbuf` bytes, set before it connects (set after,
/// the window already offered would be cut, and the kernel drop what it cannot hold).
fn client_with_rcvbuf(addr: std::net::SocketAddr, rcvbuf: usize) -> Client {
    use std::os::fd::FromRawFd;
    let std::net::SocketAddr::V4(v4) = addr else {
        panic!("an IPv4 listener: {addr}");
    };
    // SAFETY: plain socket calls on a descriptor this function owns until `from_raw_fd` takes
    // it; the option value and the address are live for the calls that read them.
    let stream = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0, "socket");
        let size = rcvbuf as libc::c_int;
        let set = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVBUF,
            (&size as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(set, 0, "SO_RCVBUF");
        let sin = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*v4.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let connected = libc::connect(
            fd,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(connected, 0, "connect");
        std::net::TcpStream::from_raw_fd(fd)
    };
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    Client {
        reader: std::io::BufReader::new(stream.try_clone().unwrap()),
        writer: stream,
    }
}

/// A reader that keeps reading a deep backlog, however slowly, is draining: it is not reaped at
/// the liveness timeout while its backlog goes out, though it sees no ping to answer (the pings
/// wait behind its backlog). The kernel holds little of a connection's unsent output, so each
/// read that frees some is seen as drain progress, not only the one that frees a third of a
/// send buffer of megabytes.
#[test]
fn a_reader_that_keeps_reading_a_deep_backlog_slowly_is_not_reaped() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.outbox.keepalive_interval_ms = 100;
        config.outbox.liveness_timeout_ms = 600;
        let server = start(config);
        let mut c = client_with_rcvbuf(server.addr, 8 << 10);
        c.send(r#"{"type":"subscribe","id":1,"stream":"slow"}"#);
        assert_eq!(c.msg()["type"], "subscribed");
        const MESSAGES: u64 = 6 << 10;
        for seq in 0..MESSAGES {
            publish(&server.engine, "slow", seq, 1 << 10);
        }
        // About 1.6 MB/s: 8 KiB, then a 5 ms pause.
        let (mut next, mut read) = (0, 0);
        while next < MESSAGES {
            let line = c
                .line()
                .unwrap_or_else(|| panic!("closed after {next} messages"));
            read += line.len() + 1;
            if read >= 8 << 10 {
                read = 0;
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            let v: serde_json::Value = serde_json::from_str(&line).unwrap();
            match v["type"].as_str() {
                Some("ping") => continue,
                Some("tick") => assert_eq!(v["seq"], next, "in order"),
                _ => panic!("closed after {next} messages: {line}"),
            }
            next += 1;
        }
    });
}

/// A client that pipelines commands while it reads the replies slowly, but all along, is held
/// back by TCP, not closed at `max_outbox_bytes`: the socket's readiness may come seconds apart
/// (the kernel signals it once much of a large send buffer is free), so at the input hold's
/// deadline the server tries a write without waiting for it, and the client's reading shows.
#[test]
fn a_client_pipelining_while_it_reads_slowly_is_held_back_not_closed() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_outbox_bytes = 64 << 10;
        let server = start(config);
        let mut c = client_with_rcvbuf(server.addr, 4096);
        const PINGS: u64 = 20_000;
        let writer = spawn_pinger(&c, PINGS);
        // About 2 000 replies (60 KB) a second, read all along.
        for id in 0..PINGS {
            let v = c.json();
            assert_eq!(v["requestId"], id, "{backend:?}: {v}");
            if id % 20 == 19 {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        writer.join().unwrap();
        assert_eq!(server.engine.stats().limit_errors, 0);
    });
}

/// A subscriber that reads nothing, sent one message several times `max_outbox_bytes` and
/// nothing after it, is closed at the limit some seconds after its socket stopped taking bytes
/// (`push::STALL_WAIT`, then a write tried), not at the liveness timeout: no later delivery is
/// needed to judge it. Its close says which limit. Subscribers idle as long before the message
/// that then read it get it whole: the wait is timed from when a socket began refusing, not
/// from the subscribe; one reading steadily through a small receive buffer, and one reading
/// 40 KB/s through a large one, whose socket shows progress only a 64 KiB segment at a time.
#[test]
fn a_subscriber_that_reads_nothing_of_one_large_message_is_closed_at_max_outbox_bytes() {
    use std::time::{Duration, Instant};
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_outbox_bytes = 256 << 10;
        // Neither keepalive nor liveness acts within the test.
        config.outbox.keepalive_interval_ms = 60_000;
        config.outbox.liveness_timeout_ms = 120_000;
        let server = start(config);
        let mut stalled = client_with_rcvbuf(server.addr, 4096);
        let mut steady = client_with_rcvbuf(server.addr, 16 << 10);
        let mut slow = Client::connect(server.addr);
        for c in [&mut stalled, &mut steady, &mut slow] {
            c.send(r#"{"type":"subscribe","id":1,"stream":"big"}"#);
            assert_eq!(c.msg()["type"], "subscribed");
        }
        // All idle for a while before the message.
        std::thread::sleep(Duration::from_millis(1500));
        let pad = 3 << 20;
        assert_eq!(publish(&server.engine, "big", 0, pad), 3);
        // 24 KiB every 15 ms; 4 KiB every 100 ms for 6 s, then as fast as it comes.
        let line_read = |got: &[u8]| got.last() == Some(&b'\n');
        let steady = std::thread::spawn(move || read_paced(steady, 24 << 10, line_read, || 15));
        let slow_until = Instant::now() + Duration::from_secs(6);
        let slow = std::thread::spawn(move || {
            read_paced(slow, 4 << 10, line_read, || {
                if Instant::now() < slow_until {
                    100
                } else {
                    0
                }
            })
        });
        eventually(
            "the stalled subscriber is closed at max_outbox_bytes",
            || server.engine.stats().limit_errors >= 1,
        );
        let rest = String::from_utf8_lossy(&stalled.rest()).into_owned();
        assert!(
            rest.contains(r#""limit":"max_outbox_bytes""#),
            "{backend:?}: the close names the limit ({} bytes read)",
            rest.len()
        );
        for (name, reader) in [("steady", steady), ("slow", slow)] {
            let got = reader.join().unwrap();
            let line: serde_json::Value = serde_json::from_slice(&got).unwrap_or_else(|e| {
                panic!(
                    "{backend:?}: the {name} reader got {} bytes, not the message: {e}; ends {:?}",
                    got.len(),
                    String::from_utf8_lossy(&got[got.len().saturating_sub(300)..])
                )
            });
            assert_eq!(line["pad"].as_str().map(str::len), Some(pad), "{backend:?}");
        }
        assert_eq!(server.engine.stats().limit_errors, 1, "{backend:?}");
    });
}

/// A shutdown waits for input its connection's output holds back: a publisher that wrote a
/// burst before the shutdown and reads its replies only after a pause has every publish of the
/// burst published and answered, in order, then the `shutdown` error, and the subscriber gets
/// every message. (Held input reads nothing, so the shard counted the connection quiet after
/// 100 ms and stopped reading: 5 594 of 20 000 were answered against `powerhub serve`, and the
/// rest were dropped without a word.)
#[test]
fn a_shutdown_waits_for_input_held_back_by_the_output_and_answers_all_of_it() {
    use std::time::Duration;
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_outbox_bytes = 64 << 10;
        let server = start(config);
        let mut sub = Client::connect(server.addr);
        sub.subscribe("held");
        let subscriber = std::thread::spawn(move || {
            let mut seqs = 0u64;
            loop {
                let v = sub.json();
                if v["code"] == "shutdown" {
                    return seqs;
                }
                assert_eq!(v["seq"], seqs, "{v}");
                seqs += 1;
            }
        });
        // A small receive buffer: the replies soon fill the socket, and the input is held.
        let mut c = client_with_rcvbuf(server.addr, 16 << 10);
        const PUBLISHES: u64 = 20_000;
        let burst = publish_burst("held", PUBLISHES, 8);
        // The kernel's buffers take the whole burst (1.7 MB) while the server holds it back.
        c.writer.write_all(burst.as_bytes()).unwrap();
        let engine = server.engine;
        let stopper = std::thread::spawn(move || engine.shutdown().unwrap());
        // Longer than the shutdown's quiet period, well within its budget (3 s).
        std::thread::sleep(Duration::from_millis(500));
        for seq in 0..PUBLISHES {
            let v = c.json();
            assert_eq!(v["type"], "published", "{backend:?}: {v}");
            assert_eq!(v["requestId"], seq, "{backend:?}: {v}");
        }
        assert_eq!(c.json()["code"], "shutdown");
        assert_eq!(subscriber.join().unwrap(), PUBLISHES, "{backend:?}");
        stopper.join().unwrap();
    });
}

/// Reads from `c`, `chunk` bytes at a time, until `done` holds for what it read (or the stream
/// ends), sleeping `pause()` ms after each read; returns what it read.
fn read_paced(
    mut c: Client,
    chunk: usize,
    done: impl Fn(&[u8]) -> bool,
    pause: impl Fn() -> u64,
) -> Vec<u8> {
    use std::io::Read;
    let (mut got, mut buf) = (Vec::new(), vec![0u8; chunk]);
    while !done(&got) {
        match c.reader.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        let ms = pause();
        if ms > 0 {
            std::thread::sleep(std::time::Duration::from_millis(ms));
        }
    }
    got
}

/// Writes `pings` pings on `c` (ids 0 on, 100 per write) from a thread of their own, so that
/// the client's reading never waits for its writing; the thread ends early if the server
/// closes.
fn spawn_pinger(c: &Client, pings: u64) -> std::thread::JoinHandle<()> {
    use std::io::Write;
    let mut w = c.writer.try_clone().unwrap();
    std::thread::spawn(move || {
        for first in (0..pings).step_by(100) {
            let lines: String = (first..first + 100)
                .map(|id| format!("{{\"type\":\"ping\",\"id\":{id}}}\n"))
                .collect();
            if w.write_all(lines.as_bytes()).is_err() {
                return;
            }
        }
    })
}

/// As `a_client_pipelining_while_it_reads_slowly_is_held_back_not_closed`, through the default
/// (large) receive buffer at about 40 KB/s: on loopback its socket shows progress only a 64 KiB
/// segment at a time, about every second and a half, and the client is still held back, not
/// closed (`push::INPUT_WAIT`); then it reads the rest at full speed and has every pong in order.
#[test]
fn a_client_pipelining_while_it_reads_slowly_through_a_large_buffer_is_held_back_not_closed() {
    use std::time::{Duration, Instant};
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.limits.max_outbox_bytes = 256 << 10;
        let server = start(config);
        let c = Client::connect(server.addr);
        const PINGS: u64 = 20_000;
        let writer = spawn_pinger(&c, PINGS);
        let slow_until = Instant::now() + Duration::from_secs(6);
        let last = format!("\"requestId\":{}}}\n", PINGS - 1);
        let got = read_paced(
            c,
            4 << 10,
            |got| got.ends_with(last.as_bytes()),
            || if Instant::now() < slow_until { 100 } else { 0 },
        );
        writer.join().unwrap();
        let text = String::from_utf8_lossy(&got);
        for (id, line) in text.lines().enumerate() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["requestId"], id as u64, "{backend:?}: {line}");
        }
        assert_eq!(text.lines().count() as u64, PINGS, "{backend:?}");
        assert_eq!(server.engine.stats().limit_errors, 0, "{backend:?}");
    });
}
