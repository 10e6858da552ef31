# Sourced by the scripts that watch the perf tool's servers with `perf` (profile-slow-consumer.sh,
# count-sends.sh), from the repository's top folder. `watch_prepare NAME EXT` checks that `perf`
# is installed, empties perf/results/NAME of its *.EXT and *.txt files, builds the server and the
# tool in release, and sets `out` (that folder) and `server` (the server binary).
watch_prepare() {
  command -v perf >/dev/null || { echo "perf (linux-perf) is not installed" >&2; exit 2; }
  out="$PWD/perf/results/$1"
  mkdir -p "$out"
  rm -f "$out"/*."$2" "$out"/*.txt
  cargo build --release -p powerhub --bin powerhub
  cargo build --release -p powerhub-perf
  server="$PWD/target/release/powerhub"
}
