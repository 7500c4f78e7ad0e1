#!/usr/bin/env bash
# What several leaders per location add up to: two locations, east and west, each of K leaders
# and F followers, every node a network namespace on one bridge running its own kg (file
# backend, --leaders-per-location=K, the leaders picked with kilo.squat.ai/leader). Each
# leader's uplink is limited by a tbf qdisc on its eth0 (RATE, standing in for its NIC); the
# followers' are not. Follower i of east streams TCP (iperf3, one stream) to follower i of west,
# all F at once, from pod address to pod address, for DURATION seconds. Prints per K the
# aggregate throughput the receivers counted, the slowest and fastest stream, and the ratio to
# the first K's aggregate:
#
#   sudo bench/leaders.sh [--leaders=1,2,4] [--followers=8] [--rate=100mbit] [--duration=10] [KG]
#
# A run on a host with more cores, or without limits (--rate=none), uses the same command. KG
# defaults to target/release/kg. KG_ARGS adds flags to every kg. Needs root, iperf3, fping, tc,
# ip, wg and jq.
set -euo pipefail

leaders_list=1,2,4
followers=8
rate=100mbit
duration=10
while [[ ${1:-} == --* ]]; do
	case $1 in
	--leaders=*) leaders_list=${1#*=} ;;
	--followers=*) followers=${1#*=} ;;
	--rate=*) rate=${1#*=} ;;
	--duration=*) duration=${1#*=} ;;
	*)
		echo "leaders.sh: unknown option $1" >&2
		exit 2
		;;
	esac
	shift
done
kg=$(realpath "${1:-target/release/kg}")
if [[ $(id -u) != 0 ]]; then
	echo "leaders.sh: needs root (network namespaces)" >&2
	exit 1
fi
for tool in iperf3 fping tc ip wg jq; do
	command -v "$tool" >/dev/null || {
		echo "leaders.sh: needs $tool (Debian: apt-get install iperf3 fping iproute2 wireguard-tools jq)" >&2
		exit 1
	}
done
[[ -x $kg ]] || {
	echo "leaders.sh: no kg at $kg (cargo build --release --bin kg)" >&2
	exit 1
}
((followers >= 1 && followers <= 100)) || {
	echo "leaders.sh: --followers must be between 1 and 100" >&2
	exit 2
}

tag=kgl$$
work=$(mktemp -d "/tmp/kilotun-leaders-XXXXXX")
fabric=$tag-f
declare -a pids=() namespaces=()

# Stops every kg and iperf3 of the current cluster and removes its namespaces.
teardown() {
	for pid in "${pids[@]:-}"; do
		[[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null || true
	done
	for _ in $(seq 100); do
		alive=0
		for pid in "${pids[@]:-}"; do
			[[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && alive=1 && break
		done
		((alive)) || break
		sleep 0.1
	done
	for pid in "${pids[@]:-}"; do
		[[ -n $pid ]] && kill -KILL "$pid" 2>/dev/null || true
	done
	pids=()
	for ns in "${namespaces[@]:-}"; do
		[[ -n $ns ]] && ip netns del "$ns" 2>/dev/null || true
	done
	namespaces=()
	ip netns del "$fabric" 2>/dev/null || true
	rm -f /var/run/wireguard/"$tag"-*.sock
}
cleanup() {
	teardown
	if [[ -n ${KEEP_LOGS:-} ]]; then
		echo "leaders.sh: the agents' logs are in $work" >&2
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT

# Node j (0-based) of location l (0: east, 1: west): its namespace, underlay and pod addresses.
ns_of() { echo "$tag-$1$2"; }
node_ip() { echo "10.251.$1.$((1 + $2))"; }
pod_net() { echo "10.$((80 + $1)).$2"; }

# One cluster of K leaders and $followers followers per location, meshed; sets $cluster.
build() {
	local k=$1 l j ns name location leader
	local size=$((k + followers))
	cluster=$work/k$k
	mkdir -p "$cluster/dir" "$cluster/keys" "$cluster/logs"
	ip netns add "$fabric"
	ip -n "$fabric" link add br0 type bridge
	ip -n "$fabric" link set br0 up
	for l in 0 1; do
		location=$([[ $l == 0 ]] && echo east || echo west)
		for ((j = 0; j < size; j++)); do
			ns=$(ns_of "$l" "$j")
			name=${location:0:1}$j
			ip netns add "$ns"
			namespaces+=("$ns")
			ip link add "v$l-$j" netns "$fabric" type veth peer name eth0 netns "$ns"
			ip -n "$fabric" link set "v$l-$j" master br0 up
			ip -n "$ns" addr add "$(node_ip "$l" "$j")/16" dev eth0
			ip -n "$ns" link set eth0 up
			ip -n "$ns" link set lo up
			ip -n "$ns" link add pods0 type bridge
			ip -n "$ns" addr add "$(pod_net "$l" "$j").1/24" dev pods0
			ip -n "$ns" link set pods0 up
			ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
			leader=
			if ((j < k)); then
				leader='    kilo.squat.ai/leader: "true"'
				if [[ $rate != none ]]; then
					tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
				fi
			fi
			cat >"$cluster/dir/$name.yaml" <<EOF
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kilo.squat.ai/location: "$location"
$leader
spec:
  podCIDR: $(pod_net "$l" "$j").0/24
EOF
		done
	done
	for l in 0 1; do
		location=$([[ $l == 0 ]] && echo east || echo west)
		for ((j = 0; j < size; j++)); do
			name=${location:0:1}$j
			# shellcheck disable=SC2086
			ip netns exec "$(ns_of "$l" "$j")" "$kg" --backend=file --cluster-dir="$cluster/dir" \
				--hostname="$name" --interface="$tag-$l$j" --key-file="$cluster/keys/$name" \
				--cni=false --encapsulate=never --resync-period=5s --leaders-per-location="$k" ${KG_ARGS:-} \
				</dev/null >/dev/null 2>>"$cluster/logs/$name.log" &
			pids+=($!)
		done
	done
}

# Until every east follower's pod reaches its west counterpart's (at most 120 s): the seconds.
wait_meshed() {
	local k=$1 start=$SECONDS j missing
	while ((SECONDS - start < 120)); do
		missing=0
		for ((j = k; j < k + followers; j++)); do
			ip netns exec "$(ns_of 0 "$j")" fping -q -r 1 -t 500 -S "$(pod_net 0 "$j").1" "$(pod_net 1 "$j").1" 2>/dev/null ||
				missing=$((missing + 1))
		done
		((missing == 0)) && {
			echo $((SECONDS - start))
			return 0
		}
		sleep 1
	done
	return 1
}

# The F streams at once; prints each stream's received bits per second, one per line.
streams() {
	local k=$1 j port=5201
	local -a clients=()
	for ((j = k; j < k + followers; j++)); do
		ip netns exec "$(ns_of 1 "$j")" iperf3 -s -1 -B "$(pod_net 1 "$j").1" -p $port >/dev/null 2>&1 &
		pids+=($!)
	done
	sleep 1
	for ((j = k; j < k + followers; j++)); do
		ip netns exec "$(ns_of 0 "$j")" iperf3 -c "$(pod_net 1 "$j").1" -B "$(pod_net 0 "$j").1" -p $port \
			-t "$duration" -J >"$work/stream-$k-$j.json" 2>/dev/null &
		clients+=($!)
	done
	for pid in "${clients[@]}"; do wait "$pid" || true; done
	for ((j = k; j < k + followers; j++)); do
		jq -r '.end.sum_received.bits_per_second // 0' "$work/stream-$k-$j.json" 2>/dev/null || echo 0
	done
}

printf 'leaders per location | meshed after | aggregate | slowest stream | fastest stream | vs first\n'
printf -- '--- | --- | --- | --- | --- | ---\n'
first=
IFS=, read -r -a ks <<<"$leaders_list"
for k in "${ks[@]}"; do
	build "$k"
	if ! meshed=$(wait_meshed "$k"); then
		echo "leaders.sh: K=$k never meshed; the agents' logs: $cluster/logs" >&2
		KEEP_LOGS=1
		exit 1
	fi
	mapfile -t bps < <(streams "$k")
	read -r sum min max < <(printf '%s\n' "${bps[@]}" | awk 'NR == 1 {min = $1; max = $1} {s += $1; if ($1 < min) min = $1; if ($1 > max) max = $1} END {printf "%.0f %.0f %.0f\n", s, min, max}')
	[[ -z $first ]] && first=$sum
	awk -v k="$k" -v m="$meshed" -v s="$sum" -v lo="$min" -v hi="$max" -v f="$first" \
		'BEGIN {printf "%d | %d s | %.1f Mbit/s | %.1f Mbit/s | %.1f Mbit/s | %.2f×\n", k, m, s / 1e6, lo / 1e6, hi / 1e6, (f > 0 ? s / f : 0)}'
	teardown
done
echo "(rate $rate on each leader's eth0, $followers streams of ${duration} s, $(nproc) cores, kg $kg)"
