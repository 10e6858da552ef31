//! Receive buffers are the shard's, not the connection's: a bounded pool per shard (io_uring's
//! provided buffers, epoll's shared pool) that connections borrow only while their input is
//! decoded. These tests drive the cases where the pool runs short or a message spans buffers,
//! on both IO backends.

mod engine_support;

use std::io::Write;

use engine_support::*;

/// More than a shard's receive buffers (64): some receives find the pool empty and are retried.
const CLIENTS: usize = 400;

#[test]
fn more_clients_sending_at_once_than_receive_buffers_all_get_their_replies() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        assert_eq!(
            server.engine.backend(),
            match backend {
                powerhub::runtime::BackendChoice::IoUring =>
                    powerhub::runtime::BackendKind::IoUring,
                _ => powerhub::runtime::BackendKind::Epoll,
            },
            "the shards run the backend asked for"
        );
        let mut clients: Vec<Client> = (0..CLIENTS).map(|_| Client::connect(server.addr)).collect();
        for round in 0..3 {
            // Every client's request is written before any reply is read, so the shards find
            // many sockets readable in the same turn.
            for (i, c) in clients.iter_mut().enumerate() {
                c.send(&format!(r#"{{"type":"ping","id":"r{round}-{i}"}}"#));
            }
            for c in &mut clients {
                assert_eq!(c.msg()["type"], "pong", "round {round}");
            }
        }
        server.engine.shutdown().unwrap();
    });
}

#[test]
fn a_message_larger_than_a_receive_buffer_and_split_across_writes_arrives_whole() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut sub = Client::connect(server.addr);
        sub.subscribe("big");
        let mut publisher = Client::connect(server.addr);
        // 200 KiB: more than one receive buffer (`RECV_BUF_LEN`, 128 KiB) for one message.
        let msg = message("big", 1, 200 << 10);
        let line = format!(r#"{{"type":"publish","id":"p1","message":{msg}}}"#);
        // Written in uneven pieces with a flush between them, so partial messages are kept
        // between receives, including one that ends a receive right before the newline.
        let bytes = line.as_bytes();
        let cuts = [1, 4096, 40_000, 100_001, bytes.len()];
        let mut start = 0;
        for &end in &cuts {
            publisher.writer.write_all(&bytes[start..end]).unwrap();
            publisher.writer.flush().unwrap();
            start = end;
        }
        publisher.send_raw(b"\n");
        // A second, small command right behind it, in the same write as nothing else.
        publisher.send(r#"{"type":"ping","id":"after"}"#);
        let reply = publisher.msg();
        assert_eq!(reply["type"], "published", "{reply}");
        assert_eq!(publisher.msg()["type"], "pong");
        assert_eq!(
            sub.line().unwrap(),
            msg,
            "the subscriber gets the message byte for byte"
        );
        server.engine.shutdown().unwrap();
    });
}

#[test]
fn many_commands_in_one_write_are_all_answered_in_order() {
    on_both_backends(|backend| {
        let server = start(base_config(backend));
        let mut c = Client::connect(server.addr);
        // ~100 KiB of pings in one write: more than one receive buffer, lines cut at buffer
        // boundaries.
        let mut batch = String::new();
        for i in 0..3000 {
            batch.push_str(&format!(r#"{{"type":"ping","id":"p{i:05}"}}"#));
            batch.push('\n');
        }
        c.send_raw(batch.as_bytes());
        for i in 0..3000 {
            let v = c.msg();
            assert_eq!(v["type"], "pong", "{v}");
            assert_eq!(v["requestId"], format!("p{i:05}"), "in order");
        }
        server.engine.shutdown().unwrap();
    });
}
