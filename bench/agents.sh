#!/usr/bin/env bash
# Many kg agents at once on one machine: N nodes, each a network namespace on one bridge, each
# running its own kg (the file backend, one cluster directory they all read and write), with
# its pods on a bridge of its own (the pod address is that bridge's, 10.64+i/256.i%256.1).
# Every node pings S other nodes' pods (a fixed random sample per node, fping: one ping, 1 s
# timeout, one retry) from its own pod address, round after round. Prints:
#   - the time from the first kg's start until a round in which every sampled pair answers;
#   - WireGuard peers with a completed handshake then, and handshakes completed per second;
#   - the handshakes answered with a cookie reply (a device under handshake load), and how many
#     lines the agents logged (and at WARN or ERROR) until then;
#   - idle CPU (% of a core) and RSS per kg, over IDLE_WINDOW seconds after convergence;
#   - with --restart-leaders, the longest gap the restart of each location's leader (SIGTERM,
#     then a new kg at once) costs pings at 10/s from another location's node to one of its
#     location's pods;
#   - with --restart-all, after all that, every kg restarted at once (SIGTERM to all, then all
#     started again: a handshake storm, every engine handshaking with all its peers at the same
#     moment): the time until every sampled pair answers again, and the cookie replies sent.
#
#   sudo bench/agents.sh [--locations=M | --full] [--sample=S] [--restart-leaders] [--restart-all] [--backend=kube] N [KG]
#
# --backend=kube runs the agents against a real API server (scripts/kube-up.sh, in the bridge's
# namespace) instead of the file backend: every kg watches Nodes, Peers and its Leases and patches
# its own Node, through a socat in its namespace that relays 127.0.0.1 to the API server.
#
# N defaults to 30, M to N/10 (Kilo's location granularity, --mesh-granularity=location),
# --full gives every node its own location (--mesh-granularity=full), S defaults to 24 (every
# other node when N ≤ 25). KG defaults to target/release/kg. KG_ARGS adds flags to every kg
# (the defaults are --encapsulate=never --resync-period=5s); CONVERGE_LIMIT (120 s) bounds the
# wait for the mesh; IDLE_WINDOW defaults to 20 s; KEEP_LOGS=1 keeps the agents' logs. Needs root,
# fping, wg, curl (and socat for --backend=kube).
set -euo pipefail

locations=
full=0
sample=24
restart_leaders=0
restart_all=0
backend=file
while [[ ${1:-} == --* ]]; do
	case $1 in
	--locations=*) locations=${1#*=} ;;
	--full) full=1 ;;
	--sample=*) sample=${1#*=} ;;
	--restart-leaders) restart_leaders=1 ;;
	--restart-all) restart_all=1 ;;
	--backend=file | --backend=kube) backend=${1#*=} ;;
	*)
		echo "agents.sh: unknown option $1" >&2
		exit 2
		;;
	esac
	shift
done
n=${1:-30}
kg=$(realpath "${2:-target/release/kg}")
converge_limit=${CONVERGE_LIMIT:-120}
idle_window=${IDLE_WINDOW:-20}
[[ -z $locations ]] && locations=$(((n + 9) / 10))
((full)) && locations=$n
((sample > n - 1)) && sample=$((n - 1))

if [[ $(id -u) != 0 ]]; then
	echo "agents.sh: needs root (network namespaces)" >&2
	exit 1
fi
tools=(fping wg ip curl)
[[ $backend == kube ]] && tools+=(socat)
for tool in "${tools[@]}"; do
	command -v "$tool" >/dev/null || {
		echo "agents.sh: needs $tool (Debian: apt-get install fping wireguard-tools iproute2 curl socat)" >&2
		exit 1
	}
done
[[ -x $kg ]] || {
	echo "agents.sh: no kg at $kg (cargo build --release --bin kg)" >&2
	exit 1
}
((n >= 2 && n <= 1000)) || {
	echo "agents.sh: N must be between 2 and 1000" >&2
	exit 2
}

tag=kga$$
work=$(mktemp -d "/tmp/kilotun-agents-XXXXXX")
mkdir -p "$work/cluster" "$work/keys" "$work/logs"
declare -a pids relays
fabric=$tag-f
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

cleanup() {
	[[ -n ${instances_saved:-} ]] && echo "$instances_saved" >"$instances"
	if [[ -n ${neigh_saved:-} ]]; then
		read -r t1 t2 t3 <<<"$(echo $neigh_saved)"
		echo "$t1" >"$neigh/gc_thresh1"
		echo "$t2" >"$neigh/gc_thresh2"
		echo "$t3" >"$neigh/gc_thresh3"
	fi
	for pid in "${pids[@]:-}"; do
		[[ -n $pid ]] && kill -TERM "$pid" 2>/dev/null || true
	done
	# Up to 10 s for them all to exit (each removes its rules and routes), then SIGKILL.
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
	for pid in "${relays[@]:-}"; do
		[[ -n $pid ]] && kill "$pid" 2>/dev/null || true
	done
	[[ $backend == kube ]] && ip netns exec "$fabric" "$root/scripts/kube-down.sh" "$work/kube" >/dev/null 2>&1
	for ((i = 0; i < n; i++)); do ip netns del "$tag-$i" 2>/dev/null || true; done
	ip netns del "$fabric" 2>/dev/null || true
	rm -f /var/run/wireguard/"$tag"-*.sock
	if [[ -n ${KEEP_LOGS:-} ]]; then
		echo "agents.sh: the agents' logs are in $work/logs" >&2
	else
		rm -rf "$work"
	fi
}
trap cleanup EXIT

node_ip() { echo "10.250.$(($1 / 250)).$((1 + $1 % 250))"; }
pod_ip() { echo "10.$((64 + $1 / 256)).$(($1 % 256)).1"; }
location() { echo "l$(($1 % locations))"; }

# Every node's namespace shares this machine's one ARP table (the kernel's neighbour tables are
# global; only the first namespace's thresholds apply), and each node holds an entry for every
# peer endpoint it sends to on the bridge: 60 nodes in a full mesh need 3,540, past the default
# limit of 1,024 ("neighbor table overflow!" in the kernel's log, ENOBUFS for the senders). A
# cluster of real machines has one table per node. The limits are raised for the run and put
# back after it.
neigh=/proc/sys/net/ipv4/neigh/default
neigh_saved=$(cat "$neigh"/gc_thresh{1,2,3})
entries=$((n * n + 1024))
echo "$entries" >"$neigh/gc_thresh3"
echo "$entries" >"$neigh/gc_thresh2"
echo "$((entries / 2))" >"$neigh/gc_thresh1"
# Each kg watches the cluster directory with an inotify instance of its own, all as root, whose
# default limit is 128 instances; past it kg lists the directory every 200 ms instead. Raised
# for the run too.
instances=/proc/sys/fs/inotify/max_user_instances
instances_saved=$(cat "$instances")
((instances_saved < n + 128)) && echo $((n + 128)) >"$instances"

ip netns add "$fabric"
ip -n "$fabric" link add br0 type bridge
ip -n "$fabric" link set br0 up
for ((i = 0; i < n; i++)); do
	ns=$tag-$i
	ip netns add "$ns"
	ip link add "v$i" netns "$fabric" type veth peer name eth0 netns "$ns"
	ip -n "$fabric" link set "v$i" master br0 up
	ip -n "$ns" addr add "$(node_ip "$i")/16" dev eth0
	ip -n "$ns" link set eth0 up
	ip -n "$ns" link set lo up
	ip -n "$ns" link add pods0 type bridge
	ip -n "$ns" addr add "$(pod_ip "$i")/24" dev pods0
	ip -n "$ns" link set pods0 up
	ip netns exec "$ns" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0
	cat >"$work/cluster/n$i.yaml" <<EOF
apiVersion: v1
kind: Node
metadata:
  name: n$i
  annotations:
    kilo.squat.ai/location: "$(location "$i")"
spec:
  podCIDR: 10.$((64 + i / 256)).$((i % 256)).0/24
EOF
done

granularity=location
((full)) && granularity=full
backend_args=(--backend=file --cluster-dir="$work/cluster")
if [[ $backend == kube ]]; then
	# The API server in the bridge's namespace, on its loopback (its certificate names
	# 127.0.0.1); a socat on the bridge's address relays to it, and one in each node's namespace
	# relays that node's 127.0.0.1 at the same port to the bridge, so one kubeconfig serves all.
	ip -n "$fabric" link set lo up
	ip -n "$fabric" addr add 10.250.255.254/16 dev br0
	env_file=$(ip netns exec "$fabric" "$root/scripts/kube-up.sh" "$work/kube" 2>"$work/kube-up.log" | tail -n1)
	# shellcheck disable=SC1090
	. "$env_file"
	ip netns exec "$fabric" socat "TCP-LISTEN:6443,bind=10.250.255.254,fork,reuseaddr" \
		"TCP:127.0.0.1:$APISERVER_PORT" 2>/dev/null &
	relays+=($!)
	for ((i = 0; i < n; i++)); do
		ip netns exec "$tag-$i" socat "TCP-LISTEN:$APISERVER_PORT,bind=127.0.0.1,fork,reuseaddr" \
			TCP:10.250.255.254:6443 2>/dev/null &
		relays+=($!)
	done
	ip netns exec "$fabric" "$KUBECTL" --kubeconfig="$KUBECONFIG" apply -f "$root/manifests/crds.yaml" >/dev/null
	ip netns exec "$fabric" "$KUBECTL" --kubeconfig="$KUBECONFIG" apply -f "$work/cluster" >/dev/null
	backend_args=(--backend=kubernetes --kubeconfig="$KUBECONFIG")
fi
start_kg() {
	local i=$1
	# shellcheck disable=SC2086
	ip netns exec "$tag-$i" "$kg" "${backend_args[@]}" \
		--hostname="n$i" --interface="$tag-$i" --key-file="$work/keys/n$i" \
		--cni=false --mesh-granularity=$granularity \
		--encapsulate=never --resync-period=5s ${KG_ARGS:-} \
		</dev/null >/dev/null 2>>"$work/logs/n$i.log" &
	pids[i]=$!
}

# Each node's sample of other nodes' pods, fixed for the run.
for ((i = 0; i < n; i++)); do
	python3 - "$i" "$n" "$sample" >"$work/targets-$i" <<'EOF'
import random, sys
i, n, s = map(int, sys.argv[1:])
rng = random.Random(i)
others = [j for j in range(n) if j != i]
for j in sorted(rng.sample(others, s)):
    print(f"10.{64 + j // 256}.{j % 256}.1")
EOF
done

# One round, in a subshell (whose only children are the pingers): every node pings its
# sample (1 s timeout, one retry); prints the pairs that did not answer.
round() {
	(
		for ((i = 0; i < n; i++)); do
			ip netns exec "$tag-$i" fping -u -t1000 -r1 -S "$(pod_ip "$i")" -f "$work/targets-$i" \
				>"$work/round-$i" 2>/dev/null &
		done
		wait
		for ((i = 0; i < n; i++)); do
			sed "s/^/n$i -> /" "$work/round-$i"
		done
	)
}
seconds_since() { awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}'; }

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

echo "agents: $n kg in $locations location(s) ($granularity granularity, $backend backend), each pinging $sample pods; kg $kg"
# Rounds until every sampled pair answers, at most CONVERGE_LIMIT seconds after $start: sets
# converged (seconds after $start, empty if never) and rounds.
wait_for_every_pair() {
	converged=
	rounds=0
	local elapsed missing
	while :; do
		elapsed=$(seconds_since "$start")
		((${elapsed%.*} >= converge_limit)) && break
		rounds=$((rounds + 1))
		missing=$(round)
		if [[ -z $missing ]]; then
			converged=$(seconds_since "$start")
			break
		fi
		echo "  round $rounds at $elapsed s: $(wc -l <<<"$missing") pair(s) unanswered" >&2
	done
}

start=$(date +%s.%N)
for ((i = 0; i < n; i++)); do start_kg "$i"; done
wait_for_every_pair

handshakes=0
peers=0
for ((i = 0; i < n; i++)); do
	while read -r _ at; do
		peers=$((peers + 1))
		((at > 0)) && handshakes=$((handshakes + 1))
	done < <(ip netns exec "$tag-$i" wg show "$tag-$i" latest-handshakes 2>/dev/null || true)
done
if [[ -n $converged ]]; then
	echo "every sampled pair answers after $converged s ($rounds rounds)"
	echo "handshakes: $handshakes of $peers peers, $(awk -v h="$handshakes" -v t="$converged" 'BEGIN {printf "%.1f", h / t}') completed a second until then"
else
	echo "NOT every sampled pair answers within $converge_limit s; unanswered in the last round:"
	round | head -20 || true
	printf 'handshakes: %d of %d peers\n' "$handshakes" "$peers"
fi

# Handshakes answered with a cookie instead (a device counting more handshake messages a second
# than it verifies unloaded), and what the agents logged until now.
cookie_replies() {
	local all=0 c i
	for ((i = 0; i < n; i++)); do
		c=$(ip netns exec "$tag-$i" curl -sf http://127.0.0.1:1107/metrics 2>/dev/null |
			awk '/^kilotun_dropped_packets_total/ && /cookie_reply_sent/ {s += $NF} END {print s + 0}')
		all=$((all + ${c:-0}))
	done
	echo "$all"
}
cookies=$(cookie_replies)
lines=$(cat "$work"/logs/*.log | wc -l)
loud=$(cat "$work"/logs/*.log | grep -c -E ' (WARN|ERROR) ' || true)
echo "cookie replies sent: $cookies in all; log lines: $lines in all, $loud of them WARN or ERROR"

# Idle CPU and RSS per kg.
declare -a before
for ((i = 0; i < n; i++)); do before[i]=$(cpu_ticks "${pids[i]}"); done
sleep "$idle_window"
hz=$(getconf CLK_TCK)
total=0
max=0
rss_total=0
for ((i = 0; i < n; i++)); do
	used=$(($(cpu_ticks "${pids[i]}") - before[i]))
	total=$((total + used))
	((used > max)) && max=$used
	rss=$(awk '/VmRSS/ {print $2}' "/proc/${pids[i]}/status" 2>/dev/null || echo 0)
	rss_total=$((rss_total + rss))
done
awk -v total="$total" -v max="$max" -v n="$n" -v hz="$hz" -v w="$idle_window" 'BEGIN {
	printf "idle CPU per kg: mean %.2f%%, max %.2f%% of a core over %d s; all %d kg: %.1f%% of a core\n",
		100 * total / n / hz / w, 100 * max / hz / w, w, n, 100 * total / hz / w }'
printf 'RSS per kg: mean %d MB\n' $((rss_total / n / 1024))

if ((restart_leaders)) && ((!full)); then
	longest=0
	for ((l = 0; l < locations; l++)); do
		leader=
		follower=
		for ((i = l; i < n; i += locations)); do
			if [[ $(ip -n "$tag-$i" -o -4 addr show dev "$tag-$i" 2>/dev/null) == *inet* ]]; then
				leader=$i
			elif [[ -z $follower ]]; then
				follower=$i
			fi
		done
		if [[ -z $leader ]]; then
			echo "location l$l: no node with an address on its WireGuard link (no leader?)" >&2
			continue
		fi
		target=$(pod_ip "${follower:-$leader}")
		from=$(((l + 1) % locations))
		ip netns exec "$tag-$from" fping -l -p 100 -t 1000 -S "$(pod_ip "$from")" "$target" \
			>"$work/gap-$l" 2>&1 &
		pinger=$!
		sleep 2
		kill -TERM "${pids[leader]}"
		wait "${pids[leader]}" 2>/dev/null || true
		start_kg "$leader"
		sleep 8
		kill -INT "$pinger" 2>/dev/null || true
		wait "$pinger" 2>/dev/null || true
		read -r gap lost < <(python3 - "$work/gap-$l" <<'EOF'
import re, sys
seqs = [int(m.group(1)) for m in re.finditer(r"\[(\d+)\], \d+ bytes", open(sys.argv[1]).read())]
gaps = [b - a - 1 for a, b in zip(seqs, seqs[1:])]
lost = (seqs[-1] - seqs[0] + 1 - len(seqs)) if seqs else 100
print(f"{max(gaps, default=100) * 0.1:.1f} {lost}")
EOF
)
		echo "leader n$leader of l$l restarted: longest gap $gap s at n$from -> $target ($lost pings lost)"
		((lost > longest)) && longest=$lost
	done
	echo "leader restarts: at most $longest pings lost per restart (10 a second)"
fi

if ((restart_all)); then
	for ((i = 0; i < n; i++)); do kill -TERM "${pids[i]}" 2>/dev/null || true; done
	for ((i = 0; i < n; i++)); do wait "${pids[i]}" 2>/dev/null || true; done
	start=$(date +%s.%N)
	for ((i = 0; i < n; i++)); do start_kg "$i"; done
	wait_for_every_pair
	if [[ -n $converged ]]; then
		echo "every kg restarted at once: every sampled pair answers again after $converged s ($rounds rounds)"
	else
		echo "every kg restarted at once: NOT every sampled pair answers within $converge_limit s"
	fi
	echo "cookie replies sent after the restart: $(cookie_replies)"
fi

