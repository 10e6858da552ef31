#!/usr/bin/env bash
# Makes the RSA keys of the JWT tests (src/security/auth.rs) under tests/keys/. The tests make
# their EC keys and certificates themselves; RSA keys are committed because generating a
# 2048-bit key in an unoptimised test build takes too long. The keys protect nothing: rerun this
# to replace them, then rerun the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
out=tests/keys
mkdir -p "$out"
# The signing key (PKCS #1, as jsonwebtoken's EncodingKey::from_rsa_der reads it) and its
# public key (SubjectPublicKeyInfo, the `PUBLIC KEY` PEM a server is configured with).
openssl genrsa -traditional -out "$out/rsa-2048.pem" 2048
openssl rsa -in "$out/rsa-2048.pem" -pubout -out "$out/rsa-2048.pub.pem"
# Another key's public half: a token signed by the first must not verify with it.
openssl genrsa -traditional 2048 | openssl rsa -pubout -out "$out/rsa-2048-other.pub.pem"
# Too short for RS256: the configuration must refuse it.
openssl genrsa -traditional 1024 | openssl rsa -pubout -out "$out/rsa-1024.pub.pem"
