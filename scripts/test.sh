#!/usr/bin/env bash
# Runs the whole test suite: unit, spec, property, integration (both IO backends), loom models,
# the real-client tests (Python websockets, headless Chromium) and the perf tool's quick smoke run
# (every scenario against powerhub, Redis, NATS and the raw baseline; fails if a system loses a
# message it should have delivered).
# Installs the system packages the tests need when they are missing (Debian/Ubuntu, as root or
# with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-test-deps.sh

echo "== cargo test (io_uring where the kernel allows it)"
# --all-targets also builds every bench and runs it once in test mode, so the benches are
# checked here without a separate `cargo bench --no-run`.
cargo test --workspace --all-targets
cargo test --workspace --doc

echo "== cargo test, epoll forced (POWERHUB_BACKEND=epoll)"
POWERHUB_BACKEND=epoll cargo test -p powerhub --tests

echo "== loom models: the ring, the shard wake-up, the fan-out listing, the users' rate buckets, the direct receivers' slots and their stats snapshot, the shards' batch seals"
export LOOM_MAX_PREEMPTIONS=2
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --test loom_ring
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --lib runtime::parker
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --lib runtime::fanout
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --lib protocol::rate
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --lib hub::slots
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --lib hub::direct
RUSTFLAGS="--cfg loom" cargo test -p powerhub --release --target-dir target/loom --lib hub::sealed::loom_tests
unset LOOM_MAX_PREEMPTIONS

echo "== perf tool, quick smoke run"
bash perf/smoke.sh
