#!/usr/bin/env bash
# Install, start and stop the peers of the benchmarks: redis-server and nats-server, each on a
# free loopback port.
#
#   perf/peers.sh start            install if missing, start both, write perf/results/peers.env
#   perf/peers.sh stop             stop what `start` started
#   perf/peers.sh run -- CMD...    start, run CMD with REDIS_ADDR/REDIS_PID/NATS_ADDR/NATS_PID
#                                  exported, then stop (also on failure or interrupt)
#
# PERF_THREADS (default 1) is the worker-thread budget: GOMAXPROCS of nats-server. Redis is
# single-threaded for pub/sub either way.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
state="$here/results"
envfile="$state/peers.env"
threads="${PERF_THREADS:-1}"

install() {
  local missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v nats-server >/dev/null 2>&1 || missing+=(nats-server)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "installing ${missing[*]}" >&2
    if [ "$(id -u)" = 0 ]; then
      apt-get update -qq >/dev/null && apt-get install -y -qq "${missing[@]}" >/dev/null
    else
      sudo apt-get update -qq >/dev/null && sudo apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
  fi
}

port_free() {
  ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$(( 20000 + RANDOM % 10000 ))
    if port_free "$p"; then echo "$p"; return 0; fi
  done
  echo "no free loopback port found" >&2
  return 1
}

wait_port() {
  for _ in $(seq 1 100); do
    if ! port_free "$1"; then return 0; fi
    sleep 0.05
  done
  echo "$2 did not start listening on 127.0.0.1:$1" >&2
  return 1
}

start() {
  install
  mkdir -p "$state"
  # Many idle connections: raise the descriptor limit the servers inherit (as far as allowed).
  ulimit -Hn 200000 2>/dev/null || true
  ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

  local rport nport
  rport=$(free_port)
  # Loopback only (--bind); protected mode off so that subscribers may connect from any
  # 127.0.0.0/8 source address (idle-connections spreads them over several).
  redis-server --save "" --appendonly no --port "$rport" --bind 127.0.0.1 \
    --maxclients 100000 --protected-mode no --daemonize no --loglevel warning \
    >"$state/redis.log" 2>&1 &
  local rpid=$!
  wait_port "$rport" redis-server

  nport=$(free_port)
  # max_payload: screenshot frames reach 2 MiB (the default limit is 1 MiB).
  printf 'max_payload: 8388608\nmax_connections: 100000\n' >"$state/nats.conf"
  GOMAXPROCS="$threads" nats-server -c "$state/nats.conf" -a 127.0.0.1 -p "$nport" \
    >"$state/nats.log" 2>&1 &
  local npid=$!
  wait_port "$nport" nats-server

  cat >"$envfile" <<ENV
export REDIS_ADDR=127.0.0.1:$rport
export REDIS_PID=$rpid
export NATS_ADDR=127.0.0.1:$nport
export NATS_PID=$npid
ENV
  echo "redis-server pid $rpid on 127.0.0.1:$rport; nats-server pid $npid on 127.0.0.1:$nport" >&2
}

stop() {
  [ -f "$envfile" ] || return 0
  # shellcheck disable=SC1090
  . "$envfile"
  for pid in "${REDIS_PID:-}" "${NATS_PID:-}"; do
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  done
  for pid in "${REDIS_PID:-}" "${NATS_PID:-}"; do
    [ -n "$pid" ] || continue
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -f "$envfile"
  echo "peers stopped" >&2
}

case "${1:-}" in
  start) start; cat "$envfile" ;;
  stop) stop ;;
  run)
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || { echo "usage: $0 run -- CMD..." >&2; exit 2; }
    start
    trap stop EXIT INT TERM
    # shellcheck disable=SC1090
    . "$envfile"
    "$@"
    ;;
  *) echo "usage: $0 start | stop | run -- CMD..." >&2; exit 2 ;;
esac
