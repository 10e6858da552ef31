#!/usr/bin/env bash
# Profiles the powerhub servers of the slow-consumer scenario and prints, per policy, what the
# server spends differently with the slow readers present.
#
#   perf/profile-slow-consumer.sh [powerhub-perf options...]
#   e.g. perf/profile-slow-consumer.sh --systems powerhub --warmup 1 --measure 5
#
# Every policy server first runs the case without slow readers, then with them (see the
# scenario), so its process life has two halves. Each server runs under `perf record`
# (cpu-clock, every thread, no call graphs), started on CPU 0 beside the load generator, never
# on the server's pinned CPU. The report compares the middle 40 % of each half (cases start and
# end near the half-way mark) and lists the symbols whose share of the server's samples changed
# most, with both shares, and the sample counts: a server whose core is fully busy has the same
# count in both halves. Profiles and reports go to perf/results/profiles/.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=perf/watch-common.sh
. perf/watch-common.sh
watch_prepare profiles data

# The perf tool starts `$POWERHUB_BIN serve --config DIR/NAME.toml` and watches that pid: the
# wrapper keeps the pid (exec) and attaches `perf record` to it from the side.
wrap="$out/powerhub-profiled"
cat >"$wrap" <<EOF
#!/usr/bin/env bash
name=\$(basename "\${@: -1}" .toml)
( sleep 0.3; exec taskset -c 0 perf record -q -F 1999 -p \$\$ -o "$out/\$name.data" ) >/dev/null 2>&1 &
exec "$server" "\$@"
EOF
chmod +x "$wrap"

POWERHUB_BIN="$wrap" perf/peers.sh run -- target/release/powerhub-perf --results "$out/run" "$@" slow-consumer
# The last `perf record` writes its file after its server has gone.
for _ in $(seq 1 100); do
  pgrep -f "perf record -q -F 1999 -p" >/dev/null || break
  sleep 0.1
done

shares() { # data file, time slice -> "symbol<TAB>percent" sorted by symbol
  { perf report -i "$1" --time "$2" --sort sym --stdio 2>/dev/null || true; } | awk '!/^#/ && /%/' |
    awk '{p=$1; $1=""; $2=""; sub(/^ +/, ""); print $0 "\t" p}' | sort -t$'\t' -k1,1
}
samples() {
  { perf report -i "$1" --time "$2" --stdio 2>/dev/null || true; } | sed -n 's/^# Samples: \([^ ]*\) .*/\1/p' | sed -n 1p
}
for data in "$out"/*.data; do
  name=$(basename "$data" .data)
  case "$name" in *drop-oldest|*drop-newest|*disconnect) ;; *) continue ;; esac
  shares "$data" 5%-45% >"$out/$name-without.txt"
  shares "$data" 55%-95% >"$out/$name-with.txt"
  {
    echo "== $name: samples without slow $(samples "$data" 5%-45%), with slow $(samples "$data" 55%-95%)"
    echo "symbol | share without slow | share with slow"
    join -t$'\t' -a1 -a2 -e 0% -o 0,1.2,2.2 "$out/$name-without.txt" "$out/$name-with.txt" |
      awk -F'\t' '{a=$2+0; b=$3+0; d=b-a; printf "%.2f\t%s | %.2f%% | %.2f%%\n", (d<0?-d:d), $1, a, b}' |
      sort -rn | head -12 | cut -f2-
  } | tee "$out/$name-diff.txt"
done
