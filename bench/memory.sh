#!/usr/bin/env bash
# Memory (as root): resident set size of kilotun and of wireguard-go, each configured through its
# UAPI socket with N peers (default 1000; each with an endpoint and two allowed IPs), read from
# /proc/PID/status. Prints a table. Usage: sudo bench/memory.sh [N]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
peers=${1:-1000}
[ "$(id -u)" = 0 ] || { echo "memory.sh: run as root (TUN devices)" >&2; exit 1; }
(cd "$root" && cargo build --release --quiet --bin kilotun)
kilotun="$root/target/release/kilotun"
work=$(mktemp -d); ns="mem$$"
cleanup() {
  ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  sleep 0.3; ip netns del "$ns" 2>/dev/null || true; rm -rf "$work"
}
trap cleanup EXIT INT TERM
ip netns add "$ns"

# One configuration for both implementations.
{
  echo "[Interface]"
  echo "PrivateKey = $(wg genkey)"
  echo "ListenPort = 51820"
  for i in $(seq 0 $((peers - 1))); do
    echo
    echo "[Peer]"
    echo "PublicKey = $(head -c 32 /dev/urandom | base64)"
    echo "Endpoint = 192.0.2.$((i % 250 + 1)):$((20000 + i))"
    echo "AllowedIPs = 10.$((i / 250 + 10)).$((i % 250)).0/24, fd00:$i::/64"
  done
} > "$work/wg.conf"

rss_of() { # name pid
  local kb; kb=$(awk '/^VmRSS:/ {print $2}' "/proc/$2/status")
  awk -v n="$1" -v p="$peers" -v kb="$kb" 'BEGIN { printf "| %s | %d | %.1f |\n", n, p, kb / 1024 }'
}

echo "| implementation | peers | RSS MiB |"
echo "| --- | --- | --- |"
for impl in kilotun wireguard-go; do
  name="m$$${impl:0:1}"
  if [ "$impl" = kilotun ]; then
    ip netns exec "$ns" "$kilotun" -f "$name" 2>/dev/null & pid=$!
  else
    command -v wireguard-go >/dev/null || { echo "| wireguard-go | - | not installed |"; continue; }
    ip netns exec "$ns" env WG_PROCESS_FOREGROUND=1 wireguard-go -f "$name" & pid=$!
  fi
  for _ in $(seq 100); do [ -S "/var/run/wireguard/$name.sock" ] && break; sleep 0.05; done
  ip netns exec "$ns" wg setconf "$name" "$work/wg.conf"
  [ "$(ip netns exec "$ns" wg show "$name" peers | wc -l)" = "$peers" ] || { echo "$impl did not take $peers peers" >&2; exit 1; }
  sleep 1
  rss_of "$impl" "$pid"
  kill "$pid"; wait "$pid" 2>/dev/null || true
done
