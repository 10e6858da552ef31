#!/usr/bin/env bash
# Installs what the test suite needs beyond the Rust toolchain: headless Chromium (the web page
# test), Python's `websockets` client (the WebSocket tests), openssl (the TLS tests), Redis and
# NATS (the perf smoke run).
# Idempotent: does nothing for what is already there.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

need_apt=()
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v nats-server >/dev/null 2>&1 || need_apt+=(nats-server)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-pip)
# The TLS end-to-end test: the test certificates (scripts/make-test-certs.sh) and `s_client`.
command -v openssl >/dev/null 2>&1 || need_apt+=(openssl)

if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! python3 -c 'import websockets.asyncio.client' >/dev/null 2>&1; then
  echo "installing: python websockets"
  python3 -m pip install --quiet --disable-pip-version-check 'websockets>=13' \
    || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages 'websockets>=13'
fi
