#!/usr/bin/env bash
# Demo (as root): a Kilo mesh with no Kubernetes and no kernel module. Four nodes in two
# locations (east: n1 n2, west: n3 n4), each a network namespace running its own `kg` on the
# file backend (one shared cluster directory); locations are bridges joined by a router namespace;
# pod CIDRs are addresses on a port-less bridge. Prints `kgctl graph`, `wg show` of a
# leader and a cross-location ping from a non-leader, then tears everything down (also on Ctrl-C).
# DEMO_KG and DEMO_KGCTL (both) run those binaries instead of building them; DEMO_SVG is where
# the picture goes (default: mesh.svg at the repository's root). DEMO_HOLD=SECONDS keeps the
# mesh up that long before tearing it down, to look around (`ip netns list`, `wg show`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "demo: run as root (network namespaces, TUN)" >&2; exit 1; }
if ! command -v wg >/dev/null || ! command -v ping >/dev/null; then
  apt-get update -qq && apt-get install -y --no-install-recommends wireguard-tools iputils-ping iproute2
fi
if [ -n "${DEMO_KG:-}" ] && [ -n "${DEMO_KGCTL:-}" ]; then
  kg=$DEMO_KG; kgctl=$DEMO_KGCTL
else
  (cd "$root" && cargo build --release --quiet --bin kg --bin kgctl)
  target=${CARGO_TARGET_DIR:-target}
  case "$target" in /*) ;; *) target="$root/$target" ;; esac
  kg="$target/release/kg"; kgctl="$target/release/kgctl"
fi
svg=${DEMO_SVG:-$root/mesh.svg}

id=$$; work=$(mktemp -d); dir="$work/cluster"; mkdir -p "$dir"
router="demo${id}r"
nodes=(n1 n2 n3 n4)
ns() { echo "demo${id}$1"; }
agents=()
cleanup() {
  for n in "${nodes[@]}"; do ip netns pids "$(ns "$n")" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
  # A kg that got SIGTERM still writes its last state into the cluster directory: the directory
  # goes only once every agent has exited (at most 10 s each, then SIGKILL).
  local pid i
  for pid in "${agents[@]}"; do
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  for n in "${nodes[@]}"; do ip netns del "$(ns "$n")" 2>/dev/null || true; done
  ip netns del "$router" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

ip netns add "$router"
ip netns exec "$router" sysctl -qw net.ipv4.ip_forward=1
for k in 0 1; do
  ip -n "$router" link add "br$k" type bridge
  ip -n "$router" addr add "192.168.$((10 * (k + 1))).254/24" dev "br$k"
  ip -n "$router" link set "br$k" up
done

i=0
for n in "${nodes[@]}"; do
  i=$((i + 1)); k=$(( (i - 1) / 2 )); loc=$([ $k = 0 ] && echo east || echo west)
  octet=$((10 * (k + 1))); n_ns=$(ns "$n")
  ip netns add "$n_ns"; ip -n "$n_ns" link set lo up
  ip link add "dm${id}$i" type veth peer name eth0 netns "$n_ns"
  ip link set "dm${id}$i" netns "$router"
  ip -n "$router" link set "dm${id}$i" master "br$k"; ip -n "$router" link set "dm${id}$i" up
  ip -n "$n_ns" addr add "192.168.$octet.$i/24" dev eth0; ip -n "$n_ns" link set eth0 up
  ip -n "$n_ns" route add default via "192.168.$octet.254"
  ip -n "$n_ns" link add pods0 type bridge
  ip -n "$n_ns" addr add "10.42.$i.1/24" dev pods0; ip -n "$n_ns" link set pods0 up
  ip netns exec "$n_ns" sysctl -qw net.ipv4.ip_forward=1
  cat > "$dir/$n.yaml" <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $n
  labels:
    topology.kubernetes.io/region: $loc
spec:
  podCIDR: 10.42.$i.0/24
EOF
  # Distinct interface names: /var/run/wireguard (the UAPI sockets) is shared by all namespaces.
  ip netns exec "$n_ns" "$kg" --backend=file --cluster-dir="$dir" --hostname="$n" \
    --interface="kilo-$n" --key-file="$work/keys/$n" --encapsulate=always --resync-period=5s \
    --threads=1 --cni=false 2>"$work/$n.log" &
  agents+=($!)
done

echo "== waiting for the mesh (n2 in east pings n4's pod address 10.42.4.1 in west)"
meshed=false
for _ in $(seq 60); do
  if ip netns exec "$(ns n2)" ping -c 1 -W 1 10.42.4.1 >/dev/null 2>&1; then meshed=true; break; fi
  sleep 0.5
done
if [ "$meshed" != true ]; then
  echo "demo: n2 could not reach 10.42.4.1 within 30 s; the agents' logs:" >&2
  for n in "${nodes[@]}"; do echo "-- $n" >&2; tail -n 20 "$work/$n.log" >&2; done
  exit 1
fi
echo "== kgctl graph"
"$kgctl" --backend=file --cluster-dir="$dir" graph | tee "$work/mesh.dot"
if command -v circo >/dev/null; then
  circo -Tsvg "$work/mesh.dot" >"$svg"
  echo "== the mesh as a picture: $svg"
else
  echo "== install graphviz to draw the mesh (circo -Tsvg)"
fi
echo "== wg show kilo-n1 (leader of east)"
ip netns exec "$(ns n1)" wg show kilo-n1
echo "== ping from n2 (east, not a leader) to n4's pod address (west)"
ip netns exec "$(ns n2)" ping -c 3 10.42.4.1
echo "== routes on n2 (everything via its leader n1 over userspace IPIP, proto static)"
ip -n "$(ns n2)" route show proto static
if [ -n "${DEMO_HOLD:-}" ]; then
  echo "== holding the mesh for ${DEMO_HOLD} s (namespaces $(ns n1) to $(ns n4))"
  sleep "$DEMO_HOLD"
fi
