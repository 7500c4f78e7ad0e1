#!/usr/bin/env bash
# Does one peer's flood starve another peer? A hub (kilotun) with two peers (kilotun too) on one
# bridge: peer `flood` sends TCP to the hub as fast as it can (iperf3, 4 streams, so the hub's
# receiving worker and its helpers are busy with that one peer), while peer `quiet` pings the hub
# through its own tunnel. Prints the quiet peer's ping RTT through the idle hub and during the
# flood, and their ratio; then the same with the hub's helpers off (KILOTUN_HELPERS=0), which is
# how the hub handled a flood before one peer's crypto was spread.
#
# Usage (as root): bench/flood_latency.sh [seconds of flood, default 10] [rounds, default 3]
# Needs: iperf3, wireguard-tools, iproute2. Builds kilotun in release mode.
set -euo pipefail

seconds=${1:-10}
rounds=${2:-3}
root=$(cd "$(dirname "$0")/.." && pwd)
(cd "$root" && cargo build --release --quiet --bin kilotun)
kilotun="${CARGO_TARGET_DIR:-$root/target}/release/kilotun"
tag="fl$$"
hub="${tag}h" flood="${tag}f" quiet="${tag}q"
work=$(mktemp -d)

cleanup() {
  for ns in "$hub" "$flood" "$quiet"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  sleep 0.3
  for ns in "$hub" "$flood" "$quiet"; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del "${tag}br" 2>/dev/null || true
  rm -f /var/run/wireguard/"${tag}"*.sock
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# The underlay: three namespaces on one bridge, 192.168.211.1 (hub), .2 (flood), .3 (quiet).
ip link add "${tag}br" type bridge
ip link set "${tag}br" up
n=0
for ns in "$hub" "$flood" "$quiet"; do
  n=$((n + 1))
  ip netns add "$ns"
  ip link add "${tag}v$n" type veth peer name "${tag}p$n"
  ip link set "${tag}v$n" netns "$ns"
  ip link set "${tag}p$n" master "${tag}br" up
  ip -n "$ns" addr add "192.168.211.$n/24" dev "${tag}v$n"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "${tag}v$n" up
  wg genkey > "$work/k$n"
done
pub() { wg pubkey < "$work/k$1"; }

# run HELPERS: starts the three daemons (the hub with HELPERS helper threads, or its default
# when empty), measures, and stops them.
run() {
  local helpers=$1 n=0
  for ns in "$hub" "$flood" "$quiet"; do
    n=$((n + 1))
    if [ "$n" = 1 ] && [ -n "$helpers" ]; then
      ip netns exec "$ns" env KILOTUN_HELPERS="$helpers" "$kilotun" "${tag}w$n"
    else
      ip netns exec "$ns" "$kilotun" "${tag}w$n"
    fi
    for _ in $(seq 100); do [ -S "/var/run/wireguard/${tag}w$n.sock" ] && break; sleep 0.05; done
    ip -n "$ns" addr add "10.81.0.$n/24" dev "${tag}w$n"
    ip -n "$ns" link set "${tag}w$n" up
  done
  ip netns exec "$hub" wg set "${tag}w1" private-key "$work/k1" listen-port 51820 \
    peer "$(pub 2)" allowed-ips 10.81.0.2/32 endpoint 192.168.211.2:51820 \
    peer "$(pub 3)" allowed-ips 10.81.0.3/32 endpoint 192.168.211.3:51820
  for n in 2 3; do
    ip netns exec "$([ $n = 2 ] && echo "$flood" || echo "$quiet")" wg set "${tag}w$n" \
      private-key "$work/k$n" listen-port 51820 \
      peer "$(pub 1)" allowed-ips 10.81.0.1/32 endpoint 192.168.211.1:51820
  done
  ip netns exec "$flood" ping -c 1 -W 5 10.81.0.1 >/dev/null
  ip netns exec "$quiet" ping -c 1 -W 5 10.81.0.1 >/dev/null
  ip netns exec "$hub" iperf3 -s -D >/dev/null 2>&1
  sleep 0.5
  local idle busy mbit
  idle=$(ip netns exec "$quiet" ping -q -c 40 -i 0.05 10.81.0.1 | awk -F/ '/rtt/ {print $5}')
  ip netns exec "$flood" iperf3 -c 10.81.0.1 -P 4 -t "$seconds" -J > "$work/iperf.json" 2>/dev/null &
  local sender=$!
  sleep 2
  busy=$(ip netns exec "$quiet" ping -q -c $(( (seconds - 3) * 20 )) -i 0.05 10.81.0.1 \
    | awk -F/ '/rtt/ {print $5}')
  wait "$sender" || true
  mbit=$(python3 -c 'import json,sys; print(round(json.load(open(sys.argv[1]))["end"]["sum_received"]["bits_per_second"]/1e6))' "$work/iperf.json")
  printf '%-14s idle %7s ms  during flood %7s ms  ratio %5s  flood %5s Mbit/s\n' \
    "helpers=${helpers:-default}" "$idle" "$busy" \
    "$(python3 -c "print(f'{$busy/$idle:.2f}')")" "$mbit"
  for ns in "$hub" "$flood" "$quiet"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  for _ in $(seq 100); do
    [ -z "$(ip netns pids "$hub")$(ip netns pids "$flood")$(ip netns pids "$quiet")" ] && break
    sleep 0.05
  done
  rm -f /var/run/wireguard/"${tag}"*.sock
  sleep 0.5
}

for _ in $(seq "$rounds"); do
  run ""
  run 0
done
