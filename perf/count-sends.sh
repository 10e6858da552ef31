#!/usr/bin/env bash
# Counts, per server and per second, what each system asks of the kernel during a scenario:
# send system calls (write, writev, sendmsg), io_uring requests, loop passes (epoll_wait,
# io_uring_enter, poll) and packets put on the loopback device. It shows how many segments a
# server cuts a message stream into: fewer, larger segments cost the receivers less.
#
#   perf/count-sends.sh [powerhub-perf options...] [scenario]
#   e.g. perf/count-sends.sh --rates 0.25 --warmup 1 --measure 5 latency
#
# Every server runs under `perf stat -I 1000` on tracepoints (needs `perf`, Debian's linux-perf
# package, and permission to trace other processes): powerhub through a wrapper that keeps its
# pid, Redis and NATS by the pids peers.sh gives, the raw baseline found by its command line.
# The summary gives, per server and per stretch of busy seconds (one stretch per case), the
# median of each counter per second. Counts and summaries go to perf/results/counts/.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=perf/watch-common.sh
. perf/watch-common.sh
watch_prepare counts csv
events=syscalls:sys_enter_write,syscalls:sys_enter_writev,syscalls:sys_enter_sendmsg
events=$events,io_uring:io_uring_submit_req,syscalls:sys_enter_io_uring_enter
events=$events,syscalls:sys_enter_epoll_wait,syscalls:sys_enter_poll,net:net_dev_xmit

wrap="$out/powerhub-counted"
cat >"$wrap" <<EOF
#!/usr/bin/env bash
name=\$(basename "\${@: -1}" .toml)
( sleep 0.2; exec perf stat -I 1000 -x, -e $events -p \$\$ -o "$out/\$name.csv" ) >/dev/null 2>&1 &
exec "$server" "\$@"
EOF
chmod +x "$wrap"

# Runs inside peers.sh (which exports the peers' pids): counts the peers and the raw baseline.
inner="$out/count-peers"
cat >"$inner" <<EOF
#!/usr/bin/env bash
perf stat -I 1000 -x, -e $events -p "\$REDIS_PID" -o "$out/redis.csv" >/dev/null 2>&1 &
r=\$!
perf stat -I 1000 -x, -e $events -p "\$NATS_PID" -o "$out/nats.csv" >/dev/null 2>&1 &
n=\$!
( for _ in \$(seq 1 6000); do
    p=\$(pgrep -f -- "__raw-server" || true)
    if [ -n "\$p" ]; then exec perf stat -I 1000 -x, -e $events -p "\$p" -o "$out/raw.csv"; fi
    sleep 0.1
  done ) >/dev/null 2>&1 &
set +e
"\$@"
rc=\$?
kill -INT "\$r" "\$n" 2>/dev/null
exit "\$rc"
EOF
chmod +x "$inner"

POWERHUB_BIN="$wrap" perf/peers.sh run -- "$inner" target/release/powerhub-perf --results "$out/run" "$@"
sleep 1
python3 - "$out" <<'EOF' | tee "$out/summary.txt"
import collections, glob, os, statistics, sys

out = sys.argv[1]
names = {"write": "write", "writev": "writev", "sendmsg": "sendmsg",
         "io_uring_submit_req": "uring reqs", "io_uring_enter": "uring_enter",
         "epoll_wait": "epoll_wait", "poll": "poll", "net_dev_xmit": "lo packets"}
for path in sorted(glob.glob(os.path.join(out, "*.csv"))):
    seconds = collections.defaultdict(dict)
    for line in open(path):
        f = line.strip().split(",")
        if line.startswith("#") or len(f) < 4 or not f[1].isdigit():
            continue
        event = f[3].split(":")[-1].replace("sys_enter_", "")
        seconds[round(float(f[0]))][names.get(event, event)] = int(f[1])
    # Busy seconds (over 1 000 packets) in runs of consecutive seconds: one run per case. The
    # first and last second of a run are partial and left out.
    runs, current, last = [], [], None
    for t in sorted(seconds):
        if seconds[t].get("lo packets", 0) > 1000 and (last is None or t == last + 1):
            current.append(t)
        else:
            if len(current) > 2:
                runs.append(current[1:-1])
            current = [t] if seconds[t].get("lo packets", 0) > 1000 else []
        last = t
    if len(current) > 2:
        runs.append(current[1:-1])
    print(f"== {os.path.basename(path)[:-4]}: median per second over each stretch of busy seconds")
    cols = [c for c in names.values() if any(seconds[t].get(c, 0) for r in runs for t in r)]
    print("seconds | " + " | ".join(cols))
    for r in runs:
        med = [statistics.median(seconds[t].get(c, 0) for t in r) for c in cols]
        print(f"{r[0]}-{r[-1]} | " + " | ".join(f"{m:,.0f}" for m in med))
EOF
