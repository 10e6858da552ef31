//! The `frame` plugin over real loopback sockets, on both backends: commands in hub frames,
//! subscriber batches delivered as the very frames the hub encoded.

mod engine_support;

use std::io::{Read, Write};
use std::net::TcpStream;

use engine_support::*;
use powerhub::plugin::frame;
use powerhub::runtime::{ListenAddr, ListenerConfig};

/// A frame-protocol client of `addr` subscribed to every device of `stream`.
fn frame_subscriber(addr: std::net::SocketAddr, stream: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(WAIT)).unwrap();
    let cmd = format!(r#"{{"type":"subscribe","id":"f","stream":"{stream}"}}"#);
    c.write_all(&frame::encode_json_batch([cmd.as_bytes()]).unwrap())
        .unwrap();
    let reply = read_frame(&mut c);
    assert_eq!(reply[0]["type"], "subscribed", "{reply:?}");
    c
}

fn read_frame(s: &mut TcpStream) -> Vec<serde_json::Value> {
    frame_messages(s)
        .iter()
        .map(|m| serde_json::from_slice(m).unwrap())
        .collect()
}

#[test]
fn frame_clients_receive_batches_as_shared_hub_frames_in_order() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.listeners = vec![ListenerConfig::tcp("frame", "127.0.0.1:0")];
        let server = start(config);
        let ListenAddr::Tcp(addr) = server.engine.listeners()[0].addr.clone() else {
            unreachable!()
        };
        let mut clients: Vec<TcpStream> = (0..3).map(|_| frame_subscriber(addr, "fr")).collect();
        let encoded_before = server.engine.hub().stats().encoded;
        for seq in 0..100 {
            publish(&server.engine, "fr", seq, 16);
        }
        for c in &mut clients {
            let mut next = 0;
            while next < 100 {
                for m in read_frame(c) {
                    assert_eq!(m["seq"], next, "{m}");
                    next += 1;
                }
            }
        }
        let encoded = server.engine.hub().stats().encoded - encoded_before;
        assert!(
            encoded < 3 * 100,
            "frames are shared by the subscribers of a batch: {encoded} encodes"
        );
        // A corrupt frame gets a final error frame, then a close.
        let c = &mut clients[0];
        c.write_all(b"XX\x01\x01\0\0\0\0\0\0\0\0").unwrap();
        let err = read_frame(c);
        assert_eq!(err[0]["type"], "error", "{err:?}");
        let mut rest = Vec::new();
        let _ = c.read_to_end(&mut rest);
    });
}

/// A frame-protocol subscriber behind its socket is under the outbox's rules, as any push
/// connection: a screenshot waiting behind the backlog is replaced by the next for its slot (its
/// batches then go as one-message frames), lossless messages keep their order, and the hub frames
/// come back once it caught up.
#[test]
fn a_frame_subscriber_behind_its_socket_keeps_one_screenshot_per_slot() {
    on_both_backends(|backend| {
        let mut config = base_config(backend);
        config.listeners = vec![ListenerConfig::tcp("frame", "127.0.0.1:0")];
        let server = start(config);
        let ListenAddr::Tcp(addr) = server.engine.listeners()[0].addr.clone() else {
            unreachable!()
        };
        let mut c = frame_subscriber(addr, "shots");
        // 16 lossless messages of 900 KiB: more than the kernel's buffers hold.
        for seq in 0..16 {
            publish(&server.engine, "shots", seq, 900 << 10);
        }
        eventually("the stalled reader's socket is full", || {
            server.engine.stats().unsent_bytes > 0
        });
        let hub = server.engine.hub();
        for json in [
            r#"{"type":"screenshot_update","stream":"shots","deviceId":"d1","captureSequence":1,"png":"x"}"#,
            r#"{"type":"screenshot_update","stream":"shots","deviceId":"d1","captureSequence":2,"png":"x"}"#,
            r#"{"type":"telemetry","stream":"shots","n":0}"#,
        ] {
            let m = powerhub::hub::Message::json(json).unwrap();
            hub.publish("shots", m, powerhub::hub::PublishOptions::default())
                .unwrap();
        }
        let (mut seqs, mut shots) = (Vec::new(), Vec::new());
        loop {
            let got = read_frame(&mut c);
            let done = got.iter().any(|m| m["type"] == "telemetry");
            for m in got {
                match m["type"].as_str() {
                    Some("tick") => seqs.push(m["seq"].as_u64().unwrap()),
                    Some("screenshot_update") => shots.push(m["captureSequence"].as_u64().unwrap()),
                    _ => {}
                }
            }
            if done {
                break;
            }
        }
        assert_eq!(seqs, (0..16).collect::<Vec<_>>(), "lossless, in order");
        assert_eq!(shots, [2], "one frame for the slot, the newest");
        // Caught up: a batch is one hub frame again.
        for seq in 0..3 {
            publish(&server.engine, "shots", 100 + seq, 16);
        }
        let mut got = Vec::new();
        while got.len() < 3 {
            got.extend(read_frame(&mut c));
        }
        let seqs: Vec<u64> = got.iter().map(|m| m["seq"].as_u64().unwrap()).collect();
        assert_eq!(seqs, [100, 101, 102]);
    });
}
