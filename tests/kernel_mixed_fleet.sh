#!/usr/bin/env bash
# A mixed fleet on a kernel that has WireGuard (run inside scripts/kernel-vm.sh by
# tests/real/kernel_vm.rs): four kg on the file backend, each a network namespace, in two locations:
#   n1 (east) --wireguard=kernel, n2 (west) --wireguard=embedded, n3 (west) --wireguard=auto,
#   n4 (west) --wireguard=embedded --ipip=userspace.
# Every kg runs with --encapsulate=always, so west's nodes reach each other over IPIP: n2 and n3
# (one on each WireGuard) over the kernel's tunl0, and n4 over kilotun's userspace IPIP, whose
# packets are the same on the wire: a location that mixes both kinds of node.
# Checks, printing one `CHECK <name> ok (at <seconds since the start> s)` line each (the test
# looks for them):
#   mesh       every node reaches every other node's pod address; west's nodes use tunl0
#   mixed-ipip n4 routes west over kilo-ipip, n2 and n3 route to n4 over tunl0
#   kinds      n1's and n3's links are the kernel's WireGuard, n2's a TUN; /status and
#              kilotun_wireguard_info say which each drives
#   restart    n1's kg restarted (kernel): pings from n2 to n1's pod pass again within 6 s
#   to-engine  n1 restarted with --wireguard=embedded: pings pass within 6 s, its link now a TUN
#   to-kernel  n2 restarted with --wireguard=kernel: pings pass within 6 s, its link now wireguard
# The goal for each gap is 1 s, and the GAP line prints what it was. The bound is not the goal:
# it tells a kg that starts handshakes at once (new sessions within a second of its start) from
# one that leaves them to the other end's timers (15 s, so more than 7 s lost in the 8 s
# window), with room for TCG emulation on a busy host, which slows kg's start several times
# over (to-engine: 1.2 to 1.3 s lost on this machine with three busy loops beside the machine,
# 5.2 s in a CI run beside the rest of the suite).
#   full       all four restarted with --mesh-granularity=full (n1 now embedded, n2 kernel, n3
#              auto, n4 embedded on userspace IPIP): every node reaches every pod again, each
#              node a peer of the three others
# Each gap is printed as `GAP <name> <lost> of <sent> pings at 10/s`. Every kg runs with
# --clean-up=false, as a kg replaced under its DaemonSet leaves the node to its successor.
# Needs root, KG (the kg binary; default target/ci/kg), ip, ping, wg, curl.
set -euo pipefail
kg=${KG:-target/ci/kg}
[ -x "$kg" ] || { echo "no kg at $kg" >&2; exit 2; }
kg=$(realpath "$kg")
id=$$; work=$(mktemp -d); dir="$work/cluster"; mkdir -p "$dir" "$work/keys"
router="kmf${id}r"
nodes=(n1 n2 n3 n4)
ns() { echo "kmf${id}$1"; }
declare -A pid
# The IPIP each node encapsulates with inside its location (--ipip).
declare -A ipip=([n1]=auto [n2]=auto [n3]=auto [n4]=userspace)
cleanup() {
  for n in "${nodes[@]}"; do ip netns pids "$(ns "$n")" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
  sleep 0.5
  for n in "${nodes[@]}"; do ip netns del "$(ns "$n")" 2>/dev/null || true; done
  ip netns del "$router" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
fail() {
  echo "FAIL: $*" >&2
  for n in "${nodes[@]}"; do echo "-- wg show on $n" >&2; ip netns exec "$(ns "$n")" wg show all >&2 || true; done
  for f in "$work"/ping-*; do echo "-- $f" >&2; cat "$f" >&2; done
  for n in "${nodes[@]}"; do echo "-- $n" >&2; tail -n 30 "$work/$n.log" >&2 || true; done
  exit 1
}

ip netns add "$router"
ip netns exec "$router" sysctl -qw net.ipv4.ip_forward=1
for k in 0 1; do
  ip -n "$router" link add "br$k" type bridge
  ip -n "$router" addr add "192.168.$((10 * (k + 1))).254/24" dev "br$k"
  ip -n "$router" link set "br$k" up
done
i=0
for n in "${nodes[@]}"; do
  i=$((i + 1)); k=$([ "$n" = n1 ] && echo 0 || echo 1); loc=$([ "$k" = 0 ] && echo east || echo west)
  octet=$((10 * (k + 1))); n_ns=$(ns "$n")
  ip netns add "$n_ns"; ip -n "$n_ns" link set lo up
  ip link add "km${id}$i" type veth peer name eth0 netns "$n_ns"
  ip link set "km${id}$i" netns "$router"
  ip -n "$router" link set "km${id}$i" master "br$k"; ip -n "$router" link set "km${id}$i" up
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
done

granularity=location
start() { # node wireguard
  local n=$1
  ip netns exec "$(ns "$n")" "$kg" --backend=file --cluster-dir="$dir" --hostname="$n" \
    --interface="kilo-$n" --key-file="$work/keys/$n" --encapsulate=always --resync-period=5s \
    --threads=1 --cni=false --clean-up=false --wireguard="$2" --ipip="${ipip[$n]}" \
    --mesh-granularity="$granularity" 2>>"$work/$n.log" &
  pid[$n]=$!
}
stop() { kill -TERM "${pid[$1]}"; wait "${pid[$1]}" 2>/dev/null || true; }
kind() {
  ip -n "$(ns "$1")" -d -j link show "kilo-$1" 2>/dev/null | grep -o '"info_kind":"[a-z]*"' | cut -d'"' -f4
}
reaches() { ip netns exec "$(ns "$1")" ping -c 1 -W 1 "$2" >/dev/null 2>&1; }
# Pings from $1 to $2 at 10/s for $3 seconds while $4... runs; prints the lost count.
gap() {
  local from=$1 to=$2 seconds=$3 name=$4; shift 4
  # -c, not -w: with a deadline, ping stops at the first ICMP error (a route missing for a moment).
  ip netns exec "$(ns "$from")" ping -D -n -i 0.1 -W 1 -c "$((seconds * 10))" "$to" >"$work/ping-$name" 2>&1 &
  local pinger=$!
  sleep 1
  local before=$EPOCHREALTIME
  "$@"
  local after=$EPOCHREALTIME
  wait "$pinger" || true
  local sent received
  sent=$(sed -n 's/^\([0-9]*\) packets transmitted.*/\1/p' "$work/ping-$name")
  received=$(sed -n 's/.* \([0-9]*\) received.*/\1/p' "$work/ping-$name")
  # The stop's share: from SIGTERM to the old kg's exit, when the new one is started.
  echo "GAP $name $((sent - received)) of $sent pings at 10/s" \
    "(the old kg took $(awk -v a="$before" -v b="$after" 'BEGIN { printf "%.2f", b - a }') s to stop)"
  grep -E "transmitted|rtt|rror|nreachable" "$work/ping-$name" | head -5 || true
  [ $((sent - received)) -le 60 ] || fail "$name lost $((sent - received)) of $sent pings"
}

pods=(10.42.1.1 10.42.2.1 10.42.3.1 10.42.4.1)
# Within 120 s: four kg start under TCG, on a host busy with the rest of the suite, and under
# 5.10 that can take more than a minute.
meshed() {
  local deadline=$((SECONDS + 120))
  while [ "$SECONDS" -lt "$deadline" ]; do
    local ok=true
    for n in "${nodes[@]}"; do for p in "${pods[@]}"; do reaches "$n" "$p" || { ok=false; break 2; }; done; done
    if $ok; then return 0; fi
    sleep 0.5
  done
  for n in "${nodes[@]}"; do
    echo "-- routes on $n" >&2; ip -n "$(ns "$n")" route show >&2
    for p in "${pods[@]}"; do reaches "$n" "$p" || echo "$n does not reach $p" >&2; done
  done
  return 1
}
start n1 kernel; start n2 embedded; start n3 auto; start n4 embedded
meshed || fail "the mesh did not form within 120 s"
# Whether $1 routes $2 (a pod CIDR) over link $3. (Not `| grep -q`: with pipefail, ip's
# SIGPIPE after an early match fails it.)
routes_over() {
  local routes line
  routes=$(ip -n "$(ns "$1")" route show proto static)
  while read -r line; do [[ "$line " == "$2 "*" dev $3 "* ]] && return 0; done <<<"$routes"
  return 1
}
# The pods may answer before a follower's routes move onto the tunnel (within a resync).
settled() { for _ in $(seq 30); do routes_over "$@" && return 0; sleep 0.5; done; return 1; }
for pair in n2:10.42.3.0/24 n3:10.42.2.0/24; do
  n=${pair%%:*}; cidr=${pair#*:}
  settled "$n" "$cidr" tunl0 || fail "$n does not route $cidr over tunl0: $(ip -n "$(ns "$n")" route show proto static)"
done
echo "CHECK mesh ok (at ${SECONDS} s)"

for n in n2 n3; do
  settled "$n" 10.42.4.0/24 tunl0 || fail "$n does not route n4's pods over tunl0: $(ip -n "$(ns "$n")" route show proto static)"
done
for cidr in 10.42.2.0/24 10.42.3.0/24; do
  settled n4 "$cidr" kilo-ipip || fail "n4 does not route $cidr over kilo-ipip: $(ip -n "$(ns n4)" route show proto static)"
done
grep -q -- "--ipip=userspace" "$work/n4.log" || fail "n4 did not log its IPIP choice"
for from in n2 n3; do reaches "$from" 10.42.4.1 || fail "$from does not reach n4's pod"; done
for to in 10.42.2.1 10.42.3.1; do reaches n4 "$to" || fail "n4 does not reach $to"; done
echo "CHECK mixed-ipip ok (at ${SECONDS} s)"

[ "$(kind n1)" = wireguard ] || fail "n1's link is $(kind n1), not wireguard"
[ "$(kind n3)" = wireguard ] || fail "n3's link is $(kind n3), not wireguard"
[ "$(kind n2)" = tun ] || fail "n2's link is $(kind n2), not tun"
[ "$(kind n4)" = tun ] || fail "n4's link is $(kind n4), not tun"
ip netns exec "$(ns n1)" wg show "kilo-n1"
for pair in n1=kernel n2=embedded n3=kernel; do
  n=${pair%=*}; want=${pair#*=}
  status=$(ip netns exec "$(ns "$n")" curl -sf http://127.0.0.1:1107/status)
  grep -q "\"wireguard\": \"$want\"" <<<"$status" || fail "$n's /status does not say $want: $status"
  metrics=$(ip netns exec "$(ns "$n")" curl -sf http://127.0.0.1:1107/metrics)
  grep -q "kilotun_wireguard_info{interface=\"kilo-$n\",implementation=\"$want\"} 1" <<<"$metrics" ||
    fail "$n's metrics lack implementation=$want: $(grep kilotun_wireguard <<<"$metrics")"
done
grep -q "driving the kernel's WireGuard on kilo-n3" "$work/n3.log" || fail "n3 did not log its choice"
echo "CHECK kinds ok (at ${SECONDS} s)"

restart_n1() { stop n1; start n1 kernel; }
gap n2 10.42.1.1 8 restart restart_n1
grep -q "kept from the last run with its sessions" "$work/n1.log" || fail "n1 did not keep its link"
echo "CHECK restart ok (at ${SECONDS} s)"

to_engine() { stop n1; start n1 embedded; }
gap n2 10.42.1.1 8 to-engine to_engine
[ "$(kind n1)" = tun ] || fail "n1's link is $(kind n1) after the switch, not tun"
echo "CHECK to-engine ok (at ${SECONDS} s)"

to_kernel() { stop n2; start n2 kernel; }
gap n1 10.42.2.1 8 to-kernel to_kernel
[ "$(kind n2)" = wireguard ] || fail "n2's link is $(kind n2) after the switch, not wireguard"
echo "CHECK to-kernel ok (at ${SECONDS} s)"

granularity=full
for n in "${nodes[@]}"; do stop "$n"; done
# Each kg finds the routes of its last run, with the other granularity, over its WireGuard link
# and its tunnel (--clean-up=false): those it no longer wants go, the rest are replaced.
start n1 embedded; start n2 kernel; start n3 auto; start n4 embedded
meshed || fail "the full mesh did not form within 120 s"
for n in "${nodes[@]}"; do
  peers=$(ip netns exec "$(ns "$n")" wg show "kilo-$n" peers | grep -c . || true)
  [ "$peers" = 3 ] || fail "$n has $peers peers in the full mesh, not 3"
done
# In the full mesh nothing goes over the tunnels any more.
for n in "${nodes[@]}"; do
  routes=$(ip -n "$(ns "$n")" route show proto static)
  [[ $routes != *"dev tunl0"* && $routes != *"dev kilo-ipip"* ]] ||
    fail "$n keeps routes over a tunnel in the full mesh: $routes"
done
echo "CHECK full ok (at ${SECONDS} s)"
