#!/usr/bin/env bash
# Make a CA and a SuperLink certificate signed by it, for TLS between SuperLink, SuperNodes
# and the flwr CLI.  Usage: docker/certs.sh [OUT_DIR] [EXTRA_DNS_NAME ...]
# Writes ca.crt, ca.key, server.pem, server.key. The certificate is valid for localhost,
# 127.0.0.1, ::1 and the compose service name "superlink", plus any names given.
set -euo pipefail
out="${1:-docker/certificates}"
shift || true
mkdir -p "$out"
names="DNS:localhost,DNS:superlink,IP:127.0.0.1,IP:::1"
for extra in "$@"; do names="$names,DNS:$extra"; done

openssl req -x509 -newkey rsa:2048 -nodes -days 365 -sha256 \
  -subj "/CN=fedstale-ca" -keyout "$out/ca.key" -out "$out/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -sha256 -subj "/CN=superlink" \
  -keyout "$out/server.key" -out "$out/server.csr" 2>/dev/null
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$names" > "$out/server.ext"
openssl x509 -req -in "$out/server.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -days 365 -sha256 -extfile "$out/server.ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/server.ext" "$out/ca.srl"
chmod 600 "$out/ca.key" "$out/server.key"
echo "certificates in $out: ca.crt server.pem server.key"
