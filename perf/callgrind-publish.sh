#!/usr/bin/env bash
# Counts the instructions the server runs per delivery (user space, callgrind): one shard on
# epoll (valgrind does not follow io_uring), N publishes of SIZE bytes to NSUBS subscribers over
# NDJSON on loopback. A count does not move with the machine's load, so two binaries compare
# exactly where the perf tool's throughput ratios move by 10-30 % from run to run.
#
#   perf/callgrind-publish.sh [BIN] [N] [SIZE] [NSUBS]
#   e.g. perf/callgrind-publish.sh target/release/powerhub 64000 64 1
#
# Needs valgrind. Prints the total and the count per delivery; the profile is left in
# perf/results/callgrind.out.* for callgrind_annotate.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/powerhub}
n=${2:-64000}
size=${3:-64}
nsubs=${4:-1}
mkdir -p perf/results
out=perf/results/callgrind.out
rm -f "$out" "$out".*
port=$(( 30000 + RANDOM % 5000 ))
valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" serve --shards 1 --backend epoll \
  --listen "ndjson=127.0.0.1:$port" >perf/results/callgrind-server.log 2>&1 &
server=$!
python3 perf/callgrind_load.py "$port" "$n" "$size" "$nsubs"
# The server is stopped from the side: dump the counts first (a signal would not run valgrind's
# exit path while the shard waits).
callgrind_control -d "$server" >/dev/null 2>&1
sleep 1
kill -9 "$server" 2>/dev/null || true
wait "$server" 2>/dev/null || true
total=$(callgrind_annotate "$out".* 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
echo "instructions: $total in all, $(( total / (n * nsubs) )) per delivery ($n publishes of $size B to $nsubs subscribers)"
