//! The codec against tungstenite on the same work, in memory: decoding a read of 64 masked
//! client text frames, and framing 64 outbound JSON messages.
//!
//! `cargo bench -p powerhub-websocket --bench codec`
#![allow(missing_docs)]

use std::io::Cursor;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use powerhub_plugin::{BytesMut, ProtocolLimits, ProtocolOutput, StreamProtocol};
use powerhub_websocket::{WebSocket, WebSocketConfig, WebSocketFactory};
use tungstenite::protocol::Role;
use tungstenite::Message;

const BATCH: usize = 64;

fn masked_text(payload: &[u8]) -> Vec<u8> {
    let key = [0x37, 0xfa, 0x21, 0x3d];
    let mut out = vec![0x81];
    match payload.len() {
        n if n < 126 => out.push(0x80 | n as u8),
        n => {
            out.push(0x80 | 126);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
    }
    out.extend_from_slice(&key);
    out.extend(payload.iter().enumerate().map(|(i, b)| b ^ key[i % 4]));
    out
}

fn upgraded() -> WebSocket {
    let factory = WebSocketFactory::new(WebSocketConfig::default()).unwrap();
    let mut conn = factory.connection(&ProtocolLimits::default());
    let mut input = BytesMut::from(
        "GET / HTTP/1.1\r\nHost: b\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
    );
    conn.decode(&mut input, &mut ProtocolOutput::default())
        .unwrap();
    conn
}

fn json(size: usize) -> Vec<u8> {
    let mut s = format!(
        "{{\"type\":\"message\",\"topic\":\"prices\",\"data\":\"{}",
        "x".repeat(size)
    );
    s.truncate(size - 2);
    s.push_str("\"}");
    s.into_bytes()
}

fn decode(c: &mut Criterion) {
    for size in [64, 1024] {
        let wire: Vec<u8> = (0..BATCH).flat_map(|_| masked_text(&json(size))).collect();
        let mut group = c.benchmark_group(format!("decode_{size}B_x{BATCH}"));
        group.throughput(Throughput::Elements(BATCH as u64));
        group.bench_function("powerhub", |b| {
            b.iter_batched(
                || {
                    (
                        upgraded(),
                        BytesMut::from(&wire[..]),
                        ProtocolOutput::default(),
                    )
                },
                |(mut conn, mut input, mut out)| {
                    conn.decode(&mut input, &mut out).unwrap();
                    assert_eq!(out.events.len(), BATCH);
                    out
                },
                BatchSize::SmallInput,
            )
        });
        group.bench_function("tungstenite", |b| {
            b.iter_batched(
                || {
                    tungstenite::WebSocket::from_raw_socket(
                        Cursor::new(wire.clone()),
                        Role::Server,
                        None,
                    )
                },
                |mut ws| {
                    let mut messages = Vec::with_capacity(BATCH);
                    for _ in 0..BATCH {
                        messages.push(ws.read().unwrap());
                    }
                    messages
                },
                BatchSize::SmallInput,
            )
        });
        group.finish();
    }
}

fn encode(c: &mut Criterion) {
    for size in [64, 1024] {
        let payload = json(size);
        let text = String::from_utf8(payload.clone()).unwrap();
        let mut group = c.benchmark_group(format!("encode_{size}B_x{BATCH}"));
        group.throughput(Throughput::Elements(BATCH as u64));
        group.bench_function("powerhub", |b| {
            let mut conn = upgraded();
            let mut out = BytesMut::with_capacity(BATCH * (size + 4));
            b.iter(|| {
                out.clear();
                for _ in 0..BATCH {
                    conn.encode_text(&payload, &mut out);
                }
                out.len()
            })
        });
        group.bench_function("tungstenite", |b| {
            let mut ws = tungstenite::WebSocket::from_raw_socket(
                Cursor::new(Vec::with_capacity(BATCH * (size + 4))),
                Role::Server,
                None,
            );
            b.iter(|| {
                ws.get_mut().get_mut().clear();
                ws.get_mut().set_position(0);
                for _ in 0..BATCH {
                    ws.write(Message::text(text.clone())).unwrap();
                }
                ws.flush().unwrap();
                ws.get_ref().get_ref().len()
            })
        });
        group.finish();
    }
}

criterion_group!(benches, decode, encode);
criterion_main!(benches);
