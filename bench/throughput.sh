#!/usr/bin/env bash
# End-to-end throughput through a WireGuard tunnel between two network namespaces over veth,
# kilotun and wireguard-go measured in the same run on the same machine, printed as a table
# with each result's ratio to wireguard-go.
#
# Usage (as root): bench/throughput.sh [seconds per run, default 10]
# Needs: iperf3, wireguard-go, wireguard-tools, iproute2; builds kilotun in release mode.
# Extra implementations: set BORINGTUN_CLI=/path/to/boringtun-cli to add boringtun-cli.
set -euo pipefail

secs=${1:-10}
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "throughput.sh: run as root (network namespaces)" >&2; exit 1; }
for tool in iperf3 wireguard-go wg ip; do
  command -v "$tool" >/dev/null || { echo "throughput.sh: $tool is missing" >&2; exit 1; }
done
(cd "$root" && cargo build --release --quiet --bin kilotun)
kilotun="$root/target/release/kilotun"

tag="tp$$"
nsa="${tag}a"; nsb="${tag}b"
work=$(mktemp -d)
cleanup() {
  for ns in "$nsa" "$nsb"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  sleep 0.3
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

setup_underlay() {
  ip netns add "$nsa"; ip netns add "$nsb"
  ip link add "${tag}va" type veth peer name "${tag}vb"
  ip link set "${tag}va" netns "$nsa"; ip link set "${tag}vb" netns "$nsb"
  ip -n "$nsa" addr add 192.168.210.1/24 dev "${tag}va"
  ip -n "$nsb" addr add 192.168.210.2/24 dev "${tag}vb"
  for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
  ip -n "$nsa" link set "${tag}va" up; ip -n "$nsb" link set "${tag}vb" up
  wg genkey > "$work/ka"; wg genkey > "$work/kb"
}

# start IMPL NS IFACE
start() {
  case "$1" in
    kilotun) ip netns exec "$2" "$kilotun" "$3" ;;
    wireguard-go) ip netns exec "$2" wireguard-go "$3" ;;
    boringtun-cli) ip netns exec "$2" env WG_SUDO=1 "$BORINGTUN_CLI" --disable-drop-privileges "$3" ;;
  esac
  for _ in $(seq 100); do [ -S "/var/run/wireguard/$3.sock" ] && return 0; sleep 0.05; done
  echo "throughput.sh: $1 did not start" >&2; exit 1
}

# tunnel IMPL: both ends run IMPL; prints nothing, leaves iperf3 server running in nsb
tunnel() {
  local impl=$1 ia="${tag}wa" ib="${tag}wb"
  start "$impl" "$nsa" "$ia"; start "$impl" "$nsb" "$ib"
  ip netns exec "$nsa" wg set "$ia" private-key "$work/ka" listen-port 51820 \
    peer "$(wg pubkey < "$work/kb")" allowed-ips 10.80.0.2/32 endpoint 192.168.210.2:51820
  ip netns exec "$nsb" wg set "$ib" private-key "$work/kb" listen-port 51820 \
    peer "$(wg pubkey < "$work/ka")" allowed-ips 10.80.0.1/32 endpoint 192.168.210.1:51820
  ip -n "$nsa" addr add 10.80.0.1/24 dev "$ia"; ip -n "$nsa" link set "$ia" up
  ip -n "$nsb" addr add 10.80.0.2/24 dev "$ib"; ip -n "$nsb" link set "$ib" up
  ip netns exec "$nsa" ping -c 1 -W 5 10.80.0.2 >/dev/null
}

teardown_tunnel() {
  for ns in "$nsa" "$nsb"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  sleep 0.5
}

# iperf STREAMS DIRECTION(fwd|rev) -> Mbit/s
iperf() {
  local flags=(-c 10.80.0.2 -t "$secs" -P "$1" -J)
  [ "$2" = rev ] && flags+=(-R)
  ip netns exec "$nsb" iperf3 -s -1 -D >/dev/null 2>&1
  sleep 0.3
  ip netns exec "$nsa" iperf3 "${flags[@]}" 2>/dev/null |
    python3 -c 'import json,sys; print(round(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"]/1e6))'
}

# udp_sustained -> "RATE LOSS": the highest offered UDP rate (Mbit/s, from a fixed ladder) whose
# loss stays under 1%, with that loss in percent; 1300-byte datagrams fit the tunnel's MTU. iperf3
# gets 4 MiB socket buffers (-w) at both ends, so what is measured is the tunnel, not iperf3's
# default 208 KiB receive buffer.
udp_sustained() {
  local best=0 best_loss=- rate loss
  for rate in 250 500 750 1000 1250 1500 2000 2500 3000 4000 5000; do
    ip netns exec "$nsb" iperf3 -s -1 -D >/dev/null 2>&1
    sleep 0.3
    loss=$(ip netns exec "$nsa" iperf3 -c 10.80.0.2 -u -l 1300 -w 4M -b "${rate}M" -t 3 -J 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum"]["lost_percent"])' || echo 100)
    if python3 -c "import sys; sys.exit(0 if $loss < 1 else 1)"; then
      best=$rate; best_loss=$(printf '%.2f' "$loss")
    else
      break
    fi
  done
  echo "$best $best_loss"
}

rtt() {
  ip netns exec "$nsa" ping -q -c 20 -i 0.05 10.80.0.2 | awk -F/ '/rtt/ {print $5}'
}

setup_underlay
impls=(wireguard-go kilotun)
[ -n "${BORINGTUN_CLI:-}" ] && impls+=(boringtun-cli)
declare -A result
for impl in "${impls[@]}"; do
  tunnel "$impl"
  for streams in 1 4; do
    for dir in fwd rev; do
      result["$impl,$streams,$dir"]=$(iperf "$streams" "$dir")
    done
  done
  result["$impl,rtt"]=$(rtt)
  result["$impl,udp"]=$(udp_sustained)
  teardown_tunnel
done

echo "# $(date -u +%F) $(nproc) cores, $(uname -r), $secs s per run"
printf '%-14s %-8s %-9s %10s %10s\n' implementation streams direction Mbit/s ratio
for impl in "${impls[@]}"; do
  for streams in 1 4; do
    for dir in fwd rev; do
      v=${result["$impl,$streams,$dir"]}; base=${result["wireguard-go,$streams,$dir"]}
      printf '%-14s %-8s %-9s %10s %10s\n' "$impl" "$streams" "$dir" "$v" \
        "$(python3 -c "print(f'{$v/$base:.2f}')")"
    done
  done
done
for impl in "${impls[@]}"; do
  printf 'ping rtt avg through idle tunnel, %s: %s ms\n' "$impl" "${result["$impl,rtt"]}"
done
for impl in "${impls[@]}"; do
  read -r rate loss <<<"${result["$impl,udp"]}"
  printf 'UDP, highest offered rate with loss under 1%%, %s: %s Mbit/s (loss %s%%)\n' "$impl" "$rate" "$loss"
done
