//! Parsing a `publish` command: the one-pass fast path that nearly every publish takes, against
//! the full parser (the iterative reader of `protocol::json`) that the same line takes when one string of
//! the message holds a `\u` escape. This is most of the server's work per publish with one
//! subscriber.
//!
//! `cargo bench --bench parse -- --warm-up-time 1 --measurement-time 3`

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use powerhub::protocol::{Command, CommandParser};

/// A publish line whose message is `size` bytes; with `escaped`, its payload string starts with
/// one `\u0078` ("x") and is otherwise the same.
fn line(size: usize, escaped: bool) -> Vec<u8> {
    let mut msg = r#"{"s":42,"t":123456789,"stream":"b","type":"t","p":""#.to_owned();
    if escaped {
        msg.push_str("\\u0078");
    }
    while msg.len() + 2 < size {
        msg.push('x');
    }
    msg.push_str(r#""}"#);
    format!(r#"{{"type":"publish","message":{msg}}}"#).into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_publish");
    group.throughput(Throughput::Elements(1));
    for size in [64usize, 1024] {
        // The same length and shape; the second starts its payload with one `\u0078`.
        for (path, escaped) in [("fast", false), ("full", true)] {
            let text = line(size, escaped);
            let mut parser = CommandParser::default();
            assert!(matches!(
                parser.parse(&mut text.clone()),
                Ok(Command::Publish { .. })
            ));
            group.bench_function(format!("{path}/{size}B"), |b| {
                b.iter_batched_ref(
                    || text.clone(),
                    |l| parser.parse(black_box(l)).map(drop),
                    BatchSize::SmallInput,
                )
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
