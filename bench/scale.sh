#!/usr/bin/env bash
# kg at scale: a real Kubernetes API server (v1.20.2, scripts/kube-up.sh) with N ready
# Nodes in L locations (100 by default) and their check-in churn (each Node's last-seen patched
# every 30 s, N/30 patches a second), and one kg (leader of its own location, so it peers with
# all L) in a network namespace. Prints kg's CPU (its own and its firewall children's) per
# event and in % of a core under churn, its idle CPU, its RSS, and the latency from a change in
# the API server to kg's engine (median and worst of K changes, 5 by default), with where the
# time went: the watch and each stage of kg's reconciles (its `kilotun::stages` lines).
#
#   sudo bench/scale.sh [--locations=L] [--change=WHAT] [--changes=K] [--layout=LAYOUT]
#                       [--flap=F] [--granularity=location|full] [--ipam=node|calico|pods]
#                       [--writes] N [KG_BINARY]
#
# N defaults to 1000 and KG_BINARY to target/release/kg. WHAT is the change measured:
#   follower  a node that does not lead its location moves to a new location (the default)
#   leader    a location's leader moves to a new location, so two locations change leaders
#   join      a new node joins an existing location
#   delete    a location's leader is deleted
#   block     a node takes one more Calico block (--ipam=calico only)
#   pod       a pod starts on a node (--ipam=pods only)
# LAYOUT is how the nodes' addresses are laid out (bench/scale_driver.py says more):
#   apart     endpoints in 10/8, internal IPs in 172.16/16 (the default)
#   internal  each endpoint the node's internal IP, one private network 172.16/12
#   wan       the nodes of internal, with kg's own node on 192.168.61.1/24 reaching 172.16/12
#             through its default gateway (a site on a routed private WAN): every leader's
#             endpoint is inside a routed internal IP, which the tunnel guard must keep out
#   ipv6      IPv6 endpoints, internal IPs and pods
#   dual      IPv4 endpoints, IPv4 and IPv6 internal IPs and pods
#   dns       endpoints as DNS names, answered by a dnsmasq in the namespace (needs dnsmasq)
#   nat       private endpoints with keepalives, the public ones discovered by other nodes
#   candidates  the nodes and kg's node of wan, every node publishing three candidates in
#             kilotun.io/endpoints, the third in 100.64/10, which kg's host black-holes. No
#             peer of the bench answers, so kg keeps probing every leader's candidates in turn
# With --granularity=full every node is kg's peer (use --change=join, which adds one: the
# others move nodes between locations, which a full mesh does not see).
# F (0 by default) is the fraction of the nodes that cross Kilo's 60 s last-seen bound every
# minute (they skip their check-ins for 75 s, then come back), as in a large cluster with a
# flaky network; kg's WireGuard configurations per second are printed with the churn.
# --ipam=calico installs Calico's CRDs (tests/real/crds/calico-ipam.yaml) and gives every node
# four /26 blocks as confirmed BlockAffinity objects, and runs kg with --ipam=calico: the
# pods' ranges are the blocks, not the Nodes' spec.podCIDR. --ipam=pods gives every node
# SCALE_PODS pods (100) with addresses in its /24, replaces SCALE_POD_CHURN of them a second (10;
# three watch events each) beside the check-ins, and runs kg with --ipam=pods: the events per
# second and CPU per event then count the pod events with the check-ins.
# --writes counts kg's own writes to the API server from the API server's audit log
# (bench/api_writes.py), by kind: its Node's annotations, the node condition, Events, the Peers'
# status, leases. It installs kilotun's CRDs and SCALE_PEERS Peers (50), which kg's node serves
# and, leading the first location (bench-local), reports the status of. After the other windows
# it prints the writes from kg's start until the churn window (the start), over WRITES_WINDOW
# seconds of steady state (600: a condition heartbeat, two of the Peers' status; the check-ins
# run again from a minute before), and over the CHANGE_WINDOW seconds (120) after one location's
# leader moves (--change=leader's move, made once more). KEEP_AUDIT=FILE keeps
# the audit log there.
# KG_ARGS adds flags to kg's command line (for example KG_ARGS=--firewall=iptables).
#
# SETTLE (95 s after kg has every peer), CHURN_WINDOW (30 s) and IDLE_WINDOW (30 s, after the
# churn has stopped) are the measuring windows' waits and lengths in seconds. "above idle" is
# the churn window's CPU less the idle window's rate over as long, per event: keep both windows
# a whole number of kg's resync periods (30 s), so each holds as many resyncs (and, with DNS
# endpoints, as many rounds of lookups).
#
# KUBELET_STATUS=1 gives each Node a real kubelet's status (conditions, node info, 50 images),
# so every watch event is as large as in a real cluster (bench/scale_driver.py).
#
# Everything (etcd, the API server, the load driver, kg) runs inside one network namespace, on
# its loopback. Needs root, python3, wg, openssl, curl; KUBE_BIN_DIR or the cache of
# scripts/kube-apiserver.sh for the control-plane binaries.
set -euo pipefail

locations=100
what=follower
changes=5
layout=apart
flap=0
granularity=location
ipam=node
writes=0
while [[ ${1:-} == --* ]]; do
	case $1 in
	--writes) writes=1 ;;
	--ipam=node | --ipam=calico | --ipam=pods) ipam=${1#*=} ;;
	--locations=*) locations=${1#*=} ;;
	--change=*) what=${1#*=} ;;
	--changes=*) changes=${1#*=} ;;
	--layout=*) layout=${1#*=} ;;
	--flap=*) flap=${1#*=} ;;
	--granularity=*) granularity=${1#*=} ;;
	*)
		echo "scale.sh: unknown option $1" >&2
		exit 2
		;;
	esac
	shift
done
case $what in
follower | leader | join | delete) ;;
block) [[ $ipam == calico ]] || {
	echo "scale.sh: --change=block needs --ipam=calico" >&2
	exit 2
} ;;
pod) [[ $ipam == pods ]] || {
	echo "scale.sh: --change=pod needs --ipam=pods" >&2
	exit 2
} ;;
*)
	echo "scale.sh: --change=$what: one of follower, leader, join, delete, block, pod" >&2
	exit 2
	;;
esac
[[ $ipam == calico && $what == join ]] && {
	echo "scale.sh: --change=join with --ipam=calico: use --change=block" >&2
	exit 2
}
[[ $ipam == pods && $what == join ]] && {
	echo "scale.sh: --change=join with --ipam=pods: use --change=pod" >&2
	exit 2
}
[[ $locations =~ ^[1-9][0-9]*$ && $changes =~ ^[1-9][0-9]*$ ]] || {
	echo "scale.sh: --locations and --changes take a positive number" >&2
	exit 2
}
case $layout in
apart | internal | wan | ipv6 | dual | dns | nat | candidates) ;;
*)
	echo "scale.sh: --layout=$layout: one of apart, internal, wan, ipv6, dual, dns, nat, candidates" >&2
	exit 2
	;;
esac
[[ $flap =~ ^(0|0?\.[0-9]+|1)$ ]] || {
	echo "scale.sh: --flap=$flap: a fraction from 0 to 1" >&2
	exit 2
}
case $granularity in
location | full) ;;
*)
	echo "scale.sh: --granularity=$granularity: location or full" >&2
	exit 2
	;;
esac
export SCALE_LOCATIONS=$locations SCALE_LAYOUT=$layout SCALE_FLAP=$flap SCALE_GRANULARITY=$granularity SCALE_IPAM=$ipam
n=${1:-1000}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kg=${2:-${CARGO_TARGET_DIR:-$root/target}/release/kg}
[[ -x $kg ]] || {
	echo "scale.sh: $kg missing (cargo build --release --bin kg)" >&2
	exit 1
}
iface=kgscale0
ns=kgscale-$$
work=$(mktemp -d /tmp/kg-scale.XXXXXX)
churn_window=${CHURN_WINDOW:-30}
idle_window=${IDLE_WINDOW:-30}
kg_pid=
churn_pid=
pod_churn_pid=
dnsmasq_pid=

cleanup() {
	set +e
	[[ -n $churn_pid ]] && kill "$churn_pid" 2>/dev/null && wait "$churn_pid" 2>/dev/null
	[[ -n $pod_churn_pid ]] && kill "$pod_churn_pid" 2>/dev/null && wait "$pod_churn_pid" 2>/dev/null
	[[ -n $kg_pid ]] && kill "$kg_pid" 2>/dev/null && wait "$kg_pid" 2>/dev/null
	[[ -n $dnsmasq_pid ]] && kill "$dnsmasq_pid" 2>/dev/null && wait "$dnsmasq_pid" 2>/dev/null
	[[ -n ${KEEP_AUDIT:-} && -f $work/audit.log ]] && cp "$work/audit.log" "$KEEP_AUDIT"
	ip netns exec "$ns" "$root/scripts/kube-down.sh" "$work/kube" >/dev/null 2>&1
	ip netns del "$ns" 2>/dev/null
	rm -rf "/etc/netns/$ns"
	rm -f "/var/run/wireguard/$iface.sock"
	rm -rf "$work"
}
trap cleanup EXIT

in_ns() { ip netns exec "$ns" "$@"; }

ip netns add "$ns"
in_ns ip link set lo up
# A veth whose far end stays outside: the node's "eth0", with the default route (IP detection).
ip link add "kgs$$" type veth peer name eth0 netns "$ns"
# kg's node is on the nodes' network, as a node of the cluster would be.
case $layout in
internal) in_ns ip addr add 172.16.255.254/12 dev eth0 ;;
wan | candidates) in_ns ip addr add 192.168.61.1/24 dev eth0 ;;
nat) in_ns ip addr add 10.200.255.254/16 dev eth0 ;;
ipv6) in_ns ip addr add fd00:172:16::ffff/64 dev eth0 nodad ;;
dual)
	in_ns ip addr add 172.16.255.254/16 dev eth0
	in_ns ip addr add fd00:172:16::ffff/64 dev eth0 nodad
	;;
*) in_ns ip addr add 172.16.255.254/16 dev eth0 ;;
esac
in_ns ip link set eth0 up
if [[ $layout == wan || $layout == candidates ]]; then
	in_ns ip route add default via 192.168.61.254 dev eth0
	[[ $layout == candidates ]] && in_ns ip route add blackhole 100.64.0.0/10
else
	in_ns ip route add default dev eth0
fi
in_ns ip -6 route add default dev eth0

if ((writes)); then
	python3 "$root/bench/api_writes.py" policy >"$work/audit-policy.yaml"
	export KUBE_APISERVER_EXTRA_FLAGS="${KUBE_APISERVER_EXTRA_FLAGS:-} --audit-policy-file=$work/audit-policy.yaml --audit-log-path=$work/audit.log --audit-log-format=json"
fi
env_file=$(in_ns "$root/scripts/kube-up.sh" "$work/kube" 2>"$work/kube-up.log" | tail -n1)
# shellcheck disable=SC1090
. "$env_file"
if ((writes)); then
	in_ns "$KUBECTL" --kubeconfig="$KUBECONFIG" apply -f "$root/manifests/crds.yaml" >/dev/null
	in_ns "$KUBECTL" --kubeconfig="$KUBECONFIG" wait --for=condition=established --timeout=60s \
		crd/peers.kilo.squat.ai >/dev/null
	python3 "$root/bench/api_writes.py" peers "${SCALE_PEERS:-50}" |
		in_ns "$KUBECTL" --kubeconfig="$KUBECONFIG" apply -f - >/dev/null
fi
# `ip netns exec` and `env` exec in place, and with DRIVER_EXEC=exec the function's subshell
# does too: a background driver's or kg's $! is then its own pid, which `kill` stops.
driver() {
	${DRIVER_EXEC:-} ip netns exec "$ns" env APISERVER_URL="$APISERVER_URL" ADMIN_TOKEN="$ADMIN_TOKEN" \
		KUBE_CA_FILE="$KUBE_CA_FILE" SCALE_LOCATIONS="$locations" SCALE_LAYOUT="$layout" SCALE_FLAP="$flap" \
		SCALE_GRANULARITY="$granularity" SCALE_IPAM="$ipam" \
		python3 "$root/bench/scale_driver.py" "$@"
}
ipam_args=()
if [[ $ipam == calico ]]; then
	in_ns "$KUBECTL" --kubeconfig="$KUBECONFIG" apply -f "$root/tests/real/crds/calico-ipam.yaml" >/dev/null
	in_ns "$KUBECTL" --kubeconfig="$KUBECONFIG" wait --for=condition=established --timeout=60s \
		crd/blockaffinities.crd.projectcalico.org crd/ipamblocks.crd.projectcalico.org >/dev/null
	ipam_args=(--ipam=calico)
elif [[ $ipam == pods ]]; then
	ipam_args=(--ipam=pods)
fi

if [[ $layout == dns ]]; then
	# A name server in the namespace (dnsmasq, on its loopback) answers for every node's
	# name; `ip netns exec` binds /etc/netns/NAME/resolv.conf over kg's /etc/resolv.conf.
	driver hosts "$((n + changes))" >"$work/names"
	in_ns dnsmasq --keep-in-foreground --no-resolv --no-hosts --bind-interfaces \
		--listen-address=127.0.0.1 --addn-hosts="$work/names" --local-ttl=0 --pid-file= \
		--user=root --group=root >"$work/dnsmasq.log" 2>&1 &
	dnsmasq_pid=$!
	mkdir -p "/etc/netns/$ns"
	echo "nameserver 127.0.0.1" >"/etc/netns/$ns/resolv.conf"
fi
start=$SECONDS
driver create "$n"
echo "created $n Nodes in $((SECONDS - start)) s" >&2

(DRIVER_EXEC=exec driver churn "$n" "$work/patches") &
churn_pid=$!
echo 0 >"$work/pod-events"
if [[ $ipam == pods ]]; then
	(DRIVER_EXEC=exec driver podchurn "$n" "$work/pod-events") &
	pod_churn_pid=$!
fi

kg_started=$(date +%s.%N)
# Warnings, and the stage times of each reconcile that computed a topology. KG_ARGS is split
# into words on purpose.
# shellcheck disable=SC2086
ip netns exec "$ns" env KG_LOG=warn,kilotun::stages=debug "$kg" --backend=kubernetes --kubeconfig="$KUBECONFIG" --hostname=kg-bench \
	--interface="$iface" --key-file="$work/key" --encapsulate=never --cni=false --mtu=1420 \
	--mesh-granularity="$granularity" \
	--listen=127.0.0.1:11070 --log-level=warn "${ipam_args[@]}" ${KG_ARGS:-} >"$work/kg.log" 2>&1 &
kg_pid=$!

# Wait until kg peers with every location (every node in a full mesh), then let it settle.
wanted_peers=$locations
[[ $granularity == full ]] && wanted_peers=$n
for ((i = 0; i < 600; i++)); do
	kill -0 "$kg_pid" 2>/dev/null || {
		echo "scale.sh: kg exited" >&2
		tail -n 20 "$work/kg.log" >&2
		exit 1
	}
	peers=$( (in_ns wg show "$iface" peers 2>/dev/null || true) | wc -l)
	((peers >= wanted_peers)) && break
	sleep 0.5
done
((peers >= wanted_peers)) || {
	echo "scale.sh: kg has $peers peers after 300 s" >&2
	tail -n 20 "$work/kg.log" >&2
	exit 1
}
pid=$kg_pid
rss() { awk '/^VmRSS/ { print int($2 / 1024) }' "/proc/$pid/status"; }
rss_start=$(rss)
# The bench's peers never answer: kg's first handshake to each of them is retried every 5 s
# for WireGuard's 90 s (REKEY_ATTEMPT_TIME), which a cluster whose peers answer never pays.
# The windows start after that.
sleep "${SETTLE:-95}"

# kg's CPU time, its own threads and the children it waited for (iptables), in clock ticks.
ticks() { awk '{ print $14 + $15 + $16 + $17 }' "/proc/$pid/stat"; }
hz=$(getconf CLK_TCK)
# Events in kg's way: check-in patches and, with --ipam=pods, the pod churn's watch events.
patches() { echo $(($(cat "$work/patches") + $(cat "$work/pod-events"))); }

# The WireGuard configurations kg applied that changed its device.
configurations() {
	in_ns curl -sf http://127.0.0.1:11070/metrics | awk '$1 == "kilotun_wireguard_configurations_total" { print $2 }'
}
t0=$(ticks)
c0=$(configurations)
p0=$(patches)
q0=$(cat "$work/pod-events")
s0=$(date +%s.%N)
sleep "$churn_window"
t1=$(ticks)
c1=$(configurations)
p1=$(patches)
q1=$(cat "$work/pod-events")
s1=$(date +%s.%N)

driver change "$n" "$iface" "$changes" "$what" >"$work/changes"
latencies=$(cut -d' ' -f1 "$work/changes" | sort -n)
median=$(echo "$latencies" | awk '{ v[NR] = $1 } END { print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
worst=$(echo "$latencies" | tail -n1)
rss_churn=$(rss)

kill "$churn_pid"
wait "$churn_pid" 2>/dev/null || true
churn_pid=
if [[ -n $pod_churn_pid ]]; then
	kill "$pod_churn_pid"
	wait "$pod_churn_pid" 2>/dev/null || true
	pod_churn_pid=
fi
sleep 2
i0=$(ticks)
sleep "$idle_window"
i1=$(ticks)

awk -v n="$n" -v hz="$hz" -v t0="$t0" -v t1="$t1" -v p0="$p0" -v p1="$p1" -v s0="$s0" -v s1="$s1" -v q0="$q0" -v q1="$q1" \
	-v i0="$i0" -v i1="$i1" -v idle="$idle_window" -v r0="$rss_start" -v r1="$rss_churn" \
	-v lat="$(echo $latencies | tr ' ' ,)" -v med="$median" -v worst="$worst" -v kg="$kg" \
	-v locations="$locations" -v what="$what" -v c0="$c0" -v c1="$c1" -v flap="$flap" 'BEGIN {
	cpu = (t1 - t0) / hz; wall = s1 - s0; events = p1 - p0
	printf "kg %s, %d nodes, %d locations, layout %s, pods from %s%s\n", kg, n, locations, ENVIRON["SCALE_LAYOUT"], ENVIRON["SCALE_IPAM"], ENVIRON["KUBELET_STATUS"] == "1" ? ", kubelet status" : ""
	printf "churn: %d patches in %.1f s (%.1f/s); kg CPU %.2f s = %.1f%% of a core, %.3f ms per event\n", \
		events, wall, events / wall, cpu, 100 * cpu / wall, events ? 1000 * cpu / events : 0
	if (q1 > q0) printf "of those, pod watch events (--ipam=pods): %d (%.1f/s)\n", q1 - q0, (q1 - q0) / wall
	printf "WireGuard configurations during the churn: %d in %.1f s (%.2f/s), %s of the nodes flapping a minute\n", \
		c1 - c0, wall, (c1 - c0) / wall, flap
	idle_rate = (i1 - i0) / hz / idle
	printf "idle: kg CPU %.2f s in %d s = %.2f%% of a core\n", (i1 - i0) / hz, idle, 100 * idle_rate
	# What the events themselves cost: the CPU of the churn window less what kg spends idle
	# (engine timers, resyncs, status) over as long.
	printf "above idle: %.3f ms per event\n", events ? 1000 * (cpu - idle_rate * wall) / events : 0
	printf "RSS: %d MB once meshed, %d MB after the churn window\n", r0, r1
	printf "%s change to engine: median %s ms, worst %s ms (%s)\n", what, med, worst, lat
}'
driver stages "$work/kg.log" "$work/changes"

if ((writes)); then
	count_writes() { in_ns python3 "$root/bench/api_writes.py" count "$work/audit.log" "$@"; }
	count_writes "$kg_started" "$s0" "start (kg's start until the churn window)"
	# Steady state is the nodes checking in: without it they turn stale after 60 s and drop out
	# of the topology one by one (each a change of the Peers' servers). The check-ins start
	# again, and a minute passes for the nodes that went stale during the idle window to return.
	(DRIVER_EXEC=exec driver churn "$n" "$work/patches") &
	churn_pid=$!
	sleep 60
	w0=$(date +%s.%N)
	sleep "${WRITES_WINDOW:-600}"
	w1=$(date +%s.%N)
	count_writes "$w0" "$w1" "steady state"
	driver change "$n" "$iface" 1 leader >/dev/null
	sleep "${CHANGE_WINDOW:-120}"
	w2=$(date +%s.%N)
	count_writes "$w1" "$w2" "a location's leader moved"
fi
