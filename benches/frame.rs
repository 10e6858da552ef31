//! Frame encode and decode: the work the hub does once per (topic, batch) and a receiver does
//! once per frame.
//!
//! `cargo bench --bench frame -- --warm-up-time 1 --measurement-time 3`

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use powerhub::plugin::frame;

fn messages(n: usize, size: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            let mut m = format!(r#"{{"seq":{i},"p":""#).into_bytes();
            m.resize(size - 2, b'x');
            m.extend_from_slice(br#""}"#);
            m
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("frame");
    for &(n, size) in &[(1usize, 64usize), (32, 64), (32, 1024)] {
        let msgs = messages(n, size);
        let slices: Vec<&[u8]> = msgs.iter().map(Vec::as_slice).collect();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(format!("encode_json/{n}x{size}B"), |b| {
            b.iter(|| frame::encode_json_batch(black_box(slices.iter().copied())).unwrap())
        });
        group.bench_function(format!("encode_ndjson/{n}x{size}B"), |b| {
            b.iter(|| frame::encode_ndjson_batch(black_box(slices.iter().copied())))
        });
        let encoded = frame::encode_json_batch(slices.iter().copied()).unwrap();
        group.bench_function(format!("decode_split_json/{n}x{size}B"), |b| {
            b.iter(|| {
                let f = frame::decode(black_box(&encoded)).unwrap();
                f.json_messages().unwrap().len()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
