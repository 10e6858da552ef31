//! The `frame` plugin over real loopback sockets, on both backends: commands in hub frames,
//! subscriber batches delivered as the very frames the hub encoded.

mod engine_support;

use std::io::{Read, Write};
use std::net::TcpStream;

use engine_support::*;
use powerhub::plugin::frame;
use powerhub::runtime::{ListenAddr, ListenerConfig};

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
        let mut clients: Vec<TcpStream> =
            (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        for c in &mut clients {
            c.set_read_timeout(Some(WAIT)).unwrap();
            let cmd =
                frame::encode_json_batch([&br#"{"type":"subscribe","id":"f","stream":"fr"}"#[..]])
                    .unwrap();
            c.write_all(&cmd).unwrap();
            let reply = read_frame(c);
            assert_eq!(reply[0]["type"], "subscribed", "{reply:?}");
        }
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
