#!/usr/bin/env bash
# What authentication costs the server per message, counted in instructions rather than
# timed: `powerhub serve` runs under callgrind (valgrind), once without and once with an
# `[auth]` section (the `powerhub-auth` system's static token, whose permissions are checked
# on every subscribe and cached per publish stream), each time for two numbers of round
# trips; the difference between the two counts, divided by the difference of round trips, is
# the server's instructions per round trip (one publish read, checked, fanned out to one
# subscriber and written), without the start, the connections and the shutdown. Instruction
# counts repeat for the same binary and inputs whatever else the machine does, so they show a
# cost difference of a fraction of a percent that timings on a shared machine cannot.
#
#   perf/auth-cost.sh [SHORT LONG]      # round trips of the two runs, default 2000 and 12000
#   BATCH=64 perf/auth-cost.sh 1920 12160   # publishes written 64 at a time, as the fanout
#                                           # scenario's publisher writes them; the counts are
#                                           # then per message (SHORT and LONG multiples of 64)
#
# Needs valgrind and python3. The server uses the epoll backend (callgrind does not follow
# io_uring's kernel-side work) and two shards (valgrind runs one thread at a time). Results
# and the servers' logs go to perf/results/auth-cost/.
set -euo pipefail
cd "$(dirname "$0")/.."
short=${1:-2000}
long=${2:-12000}
bin=${POWERHUB_BIN:-target/release/powerhub}
batch=${BATCH:-1}
out=perf/results/auth-cost
[ "$batch" = 1 ] || out=$out-batch$batch
if ! [[ $batch =~ ^[1-9][0-9]*$ ]] || (( short % batch || long % batch )); then
    echo "auth-cost: BATCH must be a positive number that divides SHORT and LONG" >&2
    exit 2
fi
mkdir -p "$out"
[ -x "$bin" ] || cargo build --release -p powerhub --bin powerhub
command -v valgrind >/dev/null || { echo "auth-cost: valgrind is needed" >&2; exit 1; }

token=perf-token-with-every-permission
config() { # $1: plain | auth
    cat <<EOF
[engine]
shards = 2
backend = "epoll"

[[listener]]
protocol = "ndjson"
address = "127.0.0.1:0"
EOF
    if [ "$1" = auth ]; then
        cat <<EOF

[[auth.tokens]]
token = "$token"
user = "perf"
permissions = { publish = { allow = [">"] }, subscribe = { allow = [">"] } }
EOF
    fi
}

# One closed loop of $2 publishes, written $3 at a time, against the server at $1 (token $4,
# or none).
client() {
    python3 - "$@" <<'EOF'
import socket, sys, threading
host, port = sys.argv[1].rsplit(":", 1)
n, batch = int(sys.argv[2]), int(sys.argv[3])
token = sys.argv[4] if len(sys.argv) > 4 else ""
hello = ('{"type":"auth","token":"%s"}\n' % token) if token else ""

def connect():
    s = socket.create_connection((host, int(port)))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s

def read_until(s, buf, needle):
    while needle not in buf:
        chunk = s.recv(65536)
        if not chunk:
            sys.exit("auth-cost: the server closed a connection")
        buf += chunk
    return buf[buf.index(needle) + len(needle):]

sub = connect()
sub.sendall((hello + '{"type":"subscribe","id":"s","stream":"rtt"}\n').encode())
rest = read_until(sub, b"", b'"type":"subscribed"')
rest = rest[rest.index(b"\n") + 1:] if b"\n" in rest else read_until(sub, rest, b"\n")
pub = connect()
pub.sendall((hello + '{"type":"ping","id":1}\n').encode())
read_until(pub, b"", b'"type":"pong"')
threading.Thread(target=lambda: [None for _ in iter(lambda: pub.recv(65536), b"")], daemon=True).start()
for i in range(0, n, batch):
    pub.sendall(b"".join(
        b'{"type":"publish","message":{"s":%9d,"stream":"rtt","type":"t","p":"xxxxxxxxxxxxxxx"}}\n' % j
        for j in range(i, i + batch)))
    rest = read_until(sub, rest, b'{"s":%9d,' % (i + batch - 1))
sub.close()
pub.close()
EOF
}

# Instructions of one server run: $1 mode, $2 round trips.
count() {
    local name="$1-$2" addr="" pid
    config "$1" >"$out/$1.toml"
    rm -f "$out/$name.callgrind"
    valgrind --tool=callgrind --callgrind-out-file="$out/$name.callgrind" \
        "$bin" serve --config "$out/$1.toml" >"$out/$name.stdout" 2>"$out/$name.log" &
    pid=$!
    for _ in $(seq 1 600); do
        if grep -q '^ready' "$out/$name.stdout" 2>/dev/null; then
            addr=$(sed -n 's/^listening ndjson //p' "$out/$name.stdout")
            break
        fi
        sleep 0.1
    done
    [ -n "$addr" ] || { echo "auth-cost: the server did not start ($out/$name.log)" >&2; kill "$pid"; exit 1; }
    if [ "$1" = auth ]; then client "$addr" "$2" "$batch" "$token"; else client "$addr" "$2" "$batch"; fi
    kill -TERM "$pid"
    wait "$pid" || true
    sed -n 's/^summary: //p; s/^totals: //p' "$out/$name.callgrind" | head -1
}

declare -A ir
for mode in plain auth; do
    for n in "$short" "$long"; do
        ir[$mode-$n]=$(count "$mode" "$n")
        echo "$mode, $n round trips: ${ir[$mode-$n]} instructions"
    done
done
python3 - "$short" "$long" "${ir[plain-$short]}" "${ir[plain-$long]}" \
    "${ir[auth-$short]}" "${ir[auth-$long]}" <<'EOF' | tee "$out/summary.txt"
import sys
short, long, ps, pl, as_, al = map(int, sys.argv[1:])
plain = (pl - ps) / (long - short)
auth = (al - as_) / (long - short)
print(f"server instructions per message: plain {plain:.0f}, auth {auth:.0f}, "
      f"auth / plain {auth / plain:.4f} ({long - short} messages between the two runs)")
EOF
