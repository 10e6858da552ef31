#!/usr/bin/env bash
# Fuzzes the parsers, codecs and the push connection with cargo-fuzz (libFuzzer, built with
# AddressSanitizer, leak detection on): each target for SECONDS (default 60), every target
# unless some are named, one after the other.
#
#   bash scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#   bash scripts/fuzz.sh 3600 command_parser        # a long run of one target
#
# Installs cargo-fuzz when it is missing; uses the nightly toolchain when there is one. Each
# target starts from its seeds and regressions (fuzz/regressions/<target>) and what earlier runs
# found (fuzz/corpus/<target>, kept between runs, ignored by git). A failing input is written to
# fuzz/artifacts/<target>/ and the script exits non-zero; keep it as a regression test by
# copying it to fuzz/regressions/<target>/ (`cargo test --test fuzz_regressions` replays that
# folder). Prints each target's executions, from libFuzzer's final "Done N runs" line.
# FUZZ_ARGS adds libFuzzer options (e.g. FUZZ_ARGS="-max_len=65536").
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

seconds=${1:-60}
[[ $# -gt 0 ]] && shift
if ! [[ $seconds =~ ^[0-9]+$ ]] || [[ $seconds -eq 0 ]]; then
    echo "usage: $0 [SECONDS_PER_TARGET] [TARGET...]" >&2
    exit 2
fi

# The sanitizer flags (-Zsanitizer=address) need a nightly compiler; without a nightly toolchain
# the stable one is told to accept them (RUSTC_BOOTSTRAP=1; its standard library ships the
# AddressSanitizer runtime).
if cargo +nightly --version >/dev/null 2>&1; then
    toolchain=(+nightly)
else
    echo "== no nightly toolchain: building with the stable one and RUSTC_BOOTSTRAP=1"
    toolchain=()
    export RUSTC_BOOTSTRAP=1
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz"
    cargo install cargo-fuzz --locked
fi

cd fuzz
if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo "${toolchain[@]}" fuzz list)
fi

echo "== building the fuzz targets (AddressSanitizer)"
cargo "${toolchain[@]}" fuzz build

# Leaks fail a run, as crashes do; a target is stopped past 2 GiB (-rss_limit_mb) or an input
# that runs over 10 s (-timeout).
export ASAN_OPTIONS="detect_leaks=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=()
summary=()
for target in "${targets[@]}"; do
    echo "== fuzzing $target for ${seconds} s"
    mkdir -p "corpus/$target"
    log="$logs/$target.log"
    # shellcheck disable=SC2086 # FUZZ_ARGS is a list of options
    if cargo "${toolchain[@]}" fuzz run "$target" "corpus/$target" "regressions/$target" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -detect_leaks=1 \
        -print_final_stats=1 ${FUZZ_ARGS:-} >"$log" 2>&1; then
        status=ok
    else
        status=FAILED
        failed+=("$target")
        tail -n 60 "$log"
    fi
    runs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | tail -n 1 || true)
    if [[ -z $runs ]]; then
        runs="$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | tail -n 1 || true)"
    fi
    summary+=("$(printf '%-22s %-7s %s' "$target" "$status" "${runs:-no final stats}")")
    echo "${summary[-1]}"
done

echo "== fuzzing summary (${seconds} s per target)"
printf '%s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "failed: ${failed[*]} (inputs in fuzz/artifacts/<target>/)" >&2
    exit 1
fi
