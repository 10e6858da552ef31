#!/usr/bin/env bash
# Makes a test CA and certificates with openssl, for trying TLS listeners and mutual TLS:
#
#   scripts/make-test-certs.sh DIR
#
# writes into DIR (created if missing):
#   ca.pem, ca.key            a self-signed CA ("powerhub test CA")
#   server.pem, server.key    a server certificate for localhost and 127.0.0.1, issued by the CA
#   client.pem, client.key    a client certificate (CN=alice), issued by the CA (mutual TLS)
#
# Point a listener at them: tls_cert = "DIR/server.pem", tls_key = "DIR/server.key", and for
# mutual TLS tls_client_ca = "DIR/ca.pem"; clients trust DIR/ca.pem. For tests only: the keys are
# written unencrypted, the certificates are valid for 30 days.
set -euo pipefail

dir=${1:?usage: make-test-certs.sh DIR}
mkdir -p "$dir"
cd "$dir"

ext=$(mktemp)
trap 'rm -f "$ext"' EXIT

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
  -subj "/CN=powerhub test CA" -keyout ca.key -out ca.pem \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  2>/dev/null

issue() { # name subject extensions
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$2" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" >"$ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 30 \
    -extfile "$ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr"
}

issue server "/CN=localhost" \
  "subjectAltName=DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth
basicConstraints=CA:FALSE"
issue client "/CN=alice" \
  "extendedKeyUsage=clientAuth
basicConstraints=CA:FALSE"
rm -f ca.srl
echo "wrote $dir/{ca,server,client}.{pem,key}"
