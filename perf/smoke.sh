#!/usr/bin/env bash
# The perf tool's quick smoke run, as CI runs it: build the server and the tool (release),
# start the peers on free loopback ports, run every scenario against every system in quick
# mode, stop the peers; then fan-out over TLS. Exits non-zero when a system did not deliver a message it should, or a
# system could not be run. Takes under two minutes once built.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p powerhub --bin powerhub
cargo build --release -p powerhub-perf
perf/peers.sh run -- target/release/powerhub-perf --quick "$@"
# The TLS systems (the tool makes their certificate and starts nats-server with TLS itself):
# fan-out only, reported in a directory of its own so that it keeps the main run's report.
target/release/powerhub-perf --quick --results perf/results/tls --systems powerhub-tls,nats-tls fanout
