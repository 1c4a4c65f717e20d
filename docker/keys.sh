#!/usr/bin/env bash
# Make one ECDSA P-384 key pair per SuperNode for SuperNode authentication.
# Usage: docker/keys.sh [OUT_DIR] [NUM_NODES]   -> supernode-<i> and supernode-<i>.pub
# Register each public key with the SuperLink (started with --enable-supernode-auth):
#   flwr supernode register OUT_DIR/supernode-<i>.pub <connection>
set -euo pipefail
out="${1:-docker/keys}"
count="${2:-3}"
mkdir -p "$out"
for ((i = 0; i < count; i++)); do
  rm -f "$out/supernode-$i" "$out/supernode-$i.pub"
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedstale-supernode-$i" -f "$out/supernode-$i"
done
echo "keys in $out: supernode-0..$((count - 1)) (+ .pub)"
