//! A 16 KiB copy made at once against the same copy in 2 KiB pieces (what the server's TLS path
//! does), with the destination 5 bytes past the source modulo 4 KiB, where a TLS record's
//! payload lands, and 100 bytes past it.
//!
//! `cargo bench --bench copy -- --warm-up-time 1 --measurement-time 3`
//!
//! With glibc 2.36 on AMD Zen 3 and 4, the copy made at once runs at a tenth of the speed of
//! the pieces, or less, at 5 bytes, and as fast at 100 (glibc bug 30994). The pieces are cut as
//! `src/copy.rs` cuts them (a private module: the loop is repeated here).

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};

const LEN: usize = 16 << 10;
const PAGE: usize = 4096;

/// The offset of `buf` at which an address is `rem` past a multiple of 4 KiB.
fn at(buf: &[u8], rem: usize) -> usize {
    let addr = buf.as_ptr() as usize;
    (PAGE - addr % PAGE) % PAGE + rem
}

fn bench(c: &mut Criterion) {
    let src_buf = vec![7u8; LEN + 2 * PAGE];
    let mut dst_buf = vec![0u8; LEN + 2 * PAGE];
    let s = at(&src_buf, 0);
    let src = &src_buf[s..s + LEN];
    let mut group = c.benchmark_group("copy");
    group.throughput(Throughput::Bytes(LEN as u64));
    for ahead in [5usize, 100] {
        let d = at(&dst_buf, ahead);
        group.bench_function(format!("whole/dst+{ahead}"), |b| {
            b.iter(|| dst_buf[d..d + LEN].copy_from_slice(black_box(src)))
        });
        group.bench_function(format!("pieces/dst+{ahead}"), |b| {
            b.iter(|| {
                let dst = &mut dst_buf[d..d + LEN];
                for (to, from) in dst.chunks_mut(2048).zip(black_box(src).chunks(2048)) {
                    to.copy_from_slice(from);
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
