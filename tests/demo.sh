#!/usr/bin/env bash
# Demo (as root): two kilotun devices, each in its own network namespace joined by veth,
# configured with stock `wg`; prints `wg show` and pings across the tunnel both ways, then
# tears everything down (also on Ctrl-C).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "demo: run as root (network namespaces, TUN)" >&2; exit 1; }
if ! command -v wg >/dev/null || ! command -v ping >/dev/null; then
  apt-get update -qq && apt-get install -y --no-install-recommends wireguard-tools iputils-ping iproute2
fi
(cd "$root" && cargo build --release --quiet --bin kilotun)
kilotun="$root/target/release/kilotun"

a="demo$$a"; b="demo$$b"; work=$(mktemp -d)
cleanup() {
  for ns in "$a" "$b"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
  sleep 0.3
  ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

ip netns add "$a"; ip netns add "$b"
ip link add "${a}v" type veth peer name "${b}v"
ip link set "${a}v" netns "$a"; ip link set "${b}v" netns "$b"
ip -n "$a" addr add 192.168.150.1/24 dev "${a}v"; ip -n "$a" link set "${a}v" up
ip -n "$b" addr add 192.168.150.2/24 dev "${b}v"; ip -n "$b" link set "${b}v" up

umask 077; wg genkey > "$work/a.key"; wg genkey > "$work/b.key"; umask 022
# Distinct names: /var/run/wireguard (the UAPI sockets) is shared by all namespaces.
ip netns exec "$a" "$kilotun" kilo-a   # detaches once the device is up, like wireguard-go
ip netns exec "$b" "$kilotun" kilo-b
ip netns exec "$a" wg set kilo-a private-key "$work/a.key" listen-port 51820 \
  peer "$(wg pubkey < "$work/b.key")" endpoint 192.168.150.2:51820 allowed-ips 10.4.0.2/32
ip netns exec "$b" wg set kilo-b private-key "$work/b.key" listen-port 51820 \
  peer "$(wg pubkey < "$work/a.key")" endpoint 192.168.150.1:51820 allowed-ips 10.4.0.1/32
ip -n "$a" addr add 10.4.0.1/24 dev kilo-a; ip -n "$a" link set kilo-a up
ip -n "$b" addr add 10.4.0.2/24 dev kilo-b; ip -n "$b" link set kilo-b up

echo "== ping node a -> node b through the tunnel"
ip netns exec "$a" ping -c 3 -i 0.2 10.4.0.2
echo "== ping node b -> node a"
ip netns exec "$b" ping -c 3 -i 0.2 10.4.0.1
echo "== wg show on node a"
ip netns exec "$a" wg show kilo-a
