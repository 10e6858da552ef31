//! Parsing a `publish` command: the one-pass fast path that nearly every publish takes, against
//! the full parser (the iterative reader of `protocol::json`) that the same line takes when one string of
//! the message holds a `\u` escape. This is most of the server's work per publish with one
//! subscriber.
//!
//! `session_publish` is the whole command through the push session, as a shard runs it
//! (`Session::parse` then `Session::handle_command_at`), without and with authentication (a
//! static token's user, every publish checked against its permissions and the reserved
//! reply types): the per-publish cost of `[auth]`.
//!
//! `ndjson_decode` is the NDJSON framing's share: one receive of 64 publish lines split into
//! lines (per line).
//!
//! `cargo bench --bench parse -- --warm-up-time 1 --measurement-time 3`; the alternating
//! measurement of `[auth]`'s cost alone: `cargo bench --bench parse -- alternating`.

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, BatchSize, Criterion, Throughput};
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use powerhub::protocol::{Action, AuthPolicy, Command, CommandParser, Session, SessionConfig};
use powerhub::security::auth::{AuthConfig, Authenticator};

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
            // As a shard parses: a line of a shared receive.
            let text = Bytes::from(line(size, escaped));
            let mut parser = CommandParser::default();
            assert!(matches!(
                parser.parse_shared(text.clone()),
                Ok(Command::Publish { .. })
            ));
            group.bench_function(format!("{path}/{size}B"), |b| {
                b.iter(|| parser.parse_shared(black_box(text.clone())).map(drop))
            });
        }
    }
    group.finish();
}

fn bench_ndjson(c: &mut Criterion) {
    use powerhub::plugin::{ProtocolFactory, ProtocolOutput};
    let mut group = c.benchmark_group("ndjson_decode");
    const LINES: usize = 64;
    group.throughput(Throughput::Elements(LINES as u64));
    for size in [64usize, 1024] {
        let mut receive = Vec::new();
        for _ in 0..LINES {
            receive.extend_from_slice(&line(size, false));
            receive.push(b'\n');
        }
        let mut proto = powerhub_ndjson::NdjsonFactory.new_connection(&Default::default());
        let mut out = ProtocolOutput::default();
        group.bench_function(format!("{size}B"), |b| {
            b.iter_batched_ref(
                || bytes::BytesMut::from(&receive[..]),
                |input| {
                    out.events.clear();
                    proto.decode(black_box(input), &mut out).unwrap();
                    assert_eq!(out.events.len(), LINES);
                },
                BatchSize::SmallInput,
            )
        });
    }
    group.finish();
}

/// A session as a shard holds one: without `[auth]`, or authenticated as a user that may
/// publish to `b` (and to a few other patterns, as a real permission set has).
fn session(auth: bool) -> Session {
    let s = Session::new(1, SessionConfig::default());
    if !auth {
        return s;
    }
    let config: AuthConfig = toml::from_str(
        r#"
        [[tokens]]
        token = "bench-token"
        user = "bench"
        permissions = { publish = { allow = ["a/*", "b", "b/>", "c/>"], deny = ["b/secret"] } }
        "#,
    )
    .expect("a valid [auth]");
    let policy = AuthPolicy::new(Arc::new(
        Authenticator::from_config(&config).expect("builds"),
    ));
    let mut s = s.with_auth(policy);
    let now = SystemTime::now();
    let ok = s.handle_line_at(
        &mut br#"{"type":"auth","token":"bench-token"}"#.to_vec(),
        now,
    );
    assert!(matches!(ok, Action::Reply(_)));
    assert_eq!(s.user(), Some("bench"));
    s
}

fn bench_session(c: &mut Criterion) {
    let mut group = c.benchmark_group("session_publish");
    group.throughput(Throughput::Elements(1));
    let now = SystemTime::now();
    for size in [64usize, 1024] {
        let text = Bytes::from(line(size, false));
        for (name, auth) in [("plain", false), ("auth", true)] {
            let mut s = session(auth);
            let run = |s: &mut Session| {
                let cmd = s.parse(black_box(text.clone())).expect("parses");
                s.handle_command_at(cmd, now)
            };
            assert!(matches!(run(&mut s), Action::Publish { .. }));
            group.bench_function(format!("{name}/{size}B"), |b| b.iter(|| run(&mut s)));
        }
    }
    group.finish();
}

/// The cost of `[auth]` per publish, measured so that the machine's drift cannot decide it:
/// 1 001 rounds of 2 000 publishes, plain and authenticated taking turns (ABBA order); the
/// ratio of each adjacent pair of rounds (1 ms or so apart), and the median of those ratios.
/// Criterion's groups above run each variant once, back to back, and on a shared machine their
/// difference is within the drift between them.
fn auth_cost_alternating() {
    const ROUNDS: usize = 1_001;
    const PER_ROUND: u32 = 2_000;
    let now = SystemTime::now();
    for size in [64usize, 1024] {
        let text = Bytes::from(line(size, false));
        let mut sessions = [session(false), session(true)];
        let mut rounds = [Vec::with_capacity(ROUNDS), Vec::with_capacity(ROUNDS)];
        for round in 0..ROUNDS {
            let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
            for which in order {
                let s = &mut sessions[which];
                let started = std::time::Instant::now();
                for _ in 0..PER_ROUND {
                    let cmd = s.parse(black_box(text.clone())).expect("parses");
                    black_box(s.handle_command_at(cmd, now));
                }
                rounds[which].push(started.elapsed().as_nanos() as f64 / f64::from(PER_ROUND));
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            (v[v.len() / 2], v[v.len() / 4], v[3 * v.len() / 4])
        };
        let mut ratios: Vec<f64> = rounds[1]
            .iter()
            .zip(&rounds[0])
            .map(|(a, p)| a / p)
            .collect();
        let (ratio, r_lo, r_hi) = median(&mut ratios);
        let (plain, p_lo, p_hi) = median(&mut rounds[0]);
        let (auth, a_lo, a_hi) = median(&mut rounds[1]);
        println!(
            "session_publish alternating {size}B: auth/plain {ratio:.3} ({r_lo:.3}–{r_hi:.3}); plain {plain:.0} ns ({p_lo:.0}–{p_hi:.0}), auth {auth:.0} ns ({a_lo:.0}–{a_hi:.0}) (medians of {ROUNDS} rounds of {PER_ROUND} each and of the pairs' ratios; quartiles in brackets)"
        );
    }
}

criterion_group!(benches, bench, bench_ndjson, bench_session);

fn main() {
    benches();
    // `cargo bench --bench parse -- <filter>` runs the alternating measurement only when the
    // filter names it (or there is none).
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-') && a != "--bench");
    if filter
        .as_deref()
        .is_none_or(|f| "session_publish alternating".contains(f) || f == "alternating")
    {
        auth_cost_alternating();
    }
    Criterion::default().configure_from_args().final_summary();
}
