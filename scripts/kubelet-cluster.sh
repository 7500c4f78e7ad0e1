#!/usr/bin/env bash
# A throwaway Kubernetes v1.20.2 cluster with real kubelets, for tests that run kilotun's
# DaemonSet as pods.
#
#   scripts/kubelet-cluster.sh up DIR N   # prints (last line of stdout) DIR/cluster.env
#   . DIR/cluster.env                     # KUBECONFIG, KUBECTL, NODE_NAMES, NODE_NETNS, ... (below)
#   scripts/kubelet-cluster.sh down DIR   # stops everything, removes namespaces, links, mounts
#
# `up` starts, on top of scripts/kube-up.sh's etcd and kube-apiserver (loopback of this host):
#   - kube-scheduler and kube-controller-manager (node IPAM: --allocate-node-cidrs, pod CIDRs
#     /24 out of KUBE_CLUSTER_CIDR; the token controller, so ServiceAccounts get token Secrets)
#   - N nodes. Node i (1..N) is a network namespace <cid>-n<i> with eth0 at 10.77.0.(10+i)/24 on a
#     bridge that lives in its own namespace <cid>-sw (10.77.0.1 there is every node's default
#     gateway; it routes nowhere; the host is on it at 10.77.0.254 and routes each node's pod
#     CIDR through the node, so the API server reaches webhooks in pods), and a mount
#     namespace (bound to DIR/ns/<i>.mnt) in which the node's own directories are bind-mounted
#     over /var/lib/kubelet, /etc/cni/net.d, /opt/cni/bin, /var/lib/kilo, /run/wireguard, /run/containerd, /run/netns, /var/log/pods,
#     /var/log/containers, /run/xtables.lock (and, for KUBE_NODE_FLAVOR=k3s, /etc/rancher/k3s and
#     /var/lib/rancher/k3s/agent/etc/cni/net.d). Each node runs its own containerd (own config,
#     root, state and socket under DIR/nodes/<i>/; the host's containerd service is not touched)
#     and its own kubelet (cgroupfs driver, --cgroup-root=/kilotun/<cid>-n<i>), both inside
#     both namespaces. The pause image (scripts/kube-node-bins.sh) and every image archive in
#     KUBE_NODE_IMAGES are imported into each node's containerd before its kubelet starts.
#     The node's 127.0.0.1:<API port> is relayed (socat, through the unix socket DIR/api.sock)
#     to the API server, so kubelets and hostNetwork pods use the host's URL and certificate.
#   - kube-system/kube-proxy, the ConfigMap kubeadm writes (key kubeconfig.conf: the API URL,
#     the pod's ServiceAccount token and CA), which manifests/kilo-kubeadm.yaml mounts.
# `up` waits until every Node is registered and has a pod CIDR (not Ready: that needs a CNI
# configuration, which the DaemonSet under test installs). On failure it undoes what it did.
#
# `down` kills the kubelets, every container of the nodes (processes in the nodes' cgroups),
# every process in a node's network or mount namespace (containerd, shims, relays), the
# scheduler, controller-manager and relay, then scripts/kube-down.sh; it removes the cgroups,
# the namespaces (and so the links) and the mounts, and restores the kernel settings the
# kubelets changed. It is idempotent. Logs stay in DIR/logs (delete DIR to discard everything).
# The empty mount points created on the host (/var/lib/kubelet, /opt/cni/bin, /var/lib/kilo, ...)
# stay: another cluster may be using them.
#
# Environment (all optional):
#   KUBE_NODE_BIN_DIR   kubelet, kube-scheduler, kube-controller-manager (default: bin/ of the
#                       cache scripts/kube-node-bins.sh prints, building it if needed)
#   KUBE_BIN_DIR        kube-apiserver, etcd, kubectl (passed to kube-up.sh)
#   KUBE_NODE_IMAGES    image archives to import on every node, separated by spaces; ARCHIVE=NAME
#                       also tags the imported image NAME (e.g. what a manifest names)
#   KUBE_CLUSTER_CIDR   pod network (default 10.244.0.0/16)
#   KUBE_NODE_FLAVOR    kubeadm (default) or k3s: where the node keeps its CNI configuration and
#                       kubeconfig (k3s: /var/lib/rancher/k3s/agent/etc/cni/net.d, the CNI
#                       plugins preinstalled in /opt/cni/bin, /etc/rancher/k3s/k3s.yaml)
#   KUBE_NODE_READY_TIMEOUT  seconds to wait for each Node to register (default 120)
#   KUBE_NODE_RUNTIMES  the OCI runtime of each node, in node order, separated by spaces: runc
#                       (the default for a node not named) or crun (Debian's crun, whose default
#                       device rules leave /dev/net/tun out, as crun did from 2022 to 2025).
#                       crun refuses a hybrid cgroup layout, so a crun node's mount namespace
#                       does without /sys/fs/cgroup/unified (the host keeps it).
#
# DIR/cluster.env exports everything DIR/env (kube-up.sh) does, and CLUSTER_ID, NODE_COUNT,
# NODE_NAMES, NODE_NETNS, NODE_IPS, NODE_MNTNS (space-separated, in node order),
# NODE_CONTAINERD_SOCKS, SWITCH_NETNS, CLUSTER_CIDR, PAUSE_IMAGE, NODE_FLAVOR, NODE_RUNTIMES.
#
# Needs root, iproute2, util-linux (unshare, nsenter), containerd, ctr, runc, iptables, socat
# (installed when missing), openssl and curl.
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
log() { printf 'kubelet-cluster.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
usage() {
	log "usage: $0 up DIR N | down DIR"
	exit 1
}
(($# >= 2)) || usage
cmd=$1
[[ $(id -u) -eq 0 ]] || die "needs root (network and mount namespaces, cgroups, containerd)"

readonly SUBNET=10.77.0
# The kernel settings kubelet's container manager sets when --protect-kernel-defaults is off.
readonly KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
	kernel.keys.root_maxkeys kernel.keys.root_maxbytes)

# True while pid $1 exists and is not a zombie.
alive() {
	local state
	state=$(awk '{ sub(/.*\) /, ""); print $1 }' "/proc/$1/stat" 2>/dev/null) || return 1
	[[ -n $state && $state != Z ]]
}

# Stops the process in pid file $1 if it still runs program $2 (comm, 15 characters at most).
stop_pidfile() {
	local pidfile=$1 comm=$2 pid i
	[[ -s $pidfile ]] || return 0
	pid=$(cat "$pidfile")
	if [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "${comm:0:15}" ]]; then
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < 100; i++)); do
			alive "$pid" || break
			sleep 0.1
		done
		if alive "$pid"; then
			kill -KILL "$pid" 2>/dev/null || true
			for ((i = 0; i < 50; i++)); do
				alive "$pid" || break
				sleep 0.1
			done
		fi
	fi
	rm -f "$pidfile"
}

# Pids of the processes whose namespace of type $1 (net, mnt) is the one bound at $2.
pids_in_ns() {
	local type=$1 file=$2 ino p
	ino=$(stat -L -c %i "$file" 2>/dev/null) || return 0
	for p in /proc/[0-9]*; do
		[[ $(readlink "$p/ns/$type" 2>/dev/null) == "$type:[$ino]" ]] && echo "${p#/proc/}"
	done
	return 0
}

# Pids in cgroup subtree $1 (a path below every hierarchy's root), any hierarchy.
pids_in_cgroup() {
	local sub=$1 h
	for h in /sys/fs/cgroup/*/; do
		[[ -d $h$sub ]] || continue
		find "$h$sub" -name cgroup.procs -exec cat {} + 2>/dev/null
	done | sort -u
}

# SIGKILLs, until none is left (or 10 s pass), what the command "$@" lists.
kill_all() {
	local i pids
	for ((i = 0; i < 50; i++)); do
		pids=$("$@" | grep -vx "$$" || true)
		[[ -n $pids ]] || return 0
		# shellcheck disable=SC2086
		kill -KILL $pids 2>/dev/null || true
		sleep 0.2
	done
	log "warning: still running after SIGKILL ($*): $("$@" | tr '\n' ' ')"
}

remove_cgroups() {
	local sub=$1 h
	for h in /sys/fs/cgroup/*/; do
		[[ -d $h$sub ]] || continue
		find "$h$sub" -depth -type d -exec rmdir {} + 2>/dev/null || true
		[[ ! -d $h$sub ]] || log "warning: cgroup $h$sub remains"
		# The shared parent, when this was its last cluster.
		rmdir "${h}kilotun" 2>/dev/null || true
	done
}

########################################################################################################
down() {
	local dir=$1 state cid n i ns mnt
	state="$dir/cluster.state"
	if [[ -s $state ]]; then
		# shellcheck disable=SC1090
		source "$state"
		cid=${CID:-}
		n=${NODES_CREATED:-0}
		for ((i = 1; i <= n; i++)); do
			ns="$cid-n$i"
			mnt="$dir/ns/$i.mnt"
			# The kubelet first, so that it restarts nothing.
			stop_pidfile "$dir/nodes/$i/kubelet.pid" kubelet
			# Every container of the node (its cgroups), then whatever is left in its namespaces:
			# containerd, the shims, the API relay.
			kill_all pids_in_cgroup "kilotun/$cid-n$i"
			if [[ -e /run/netns/$ns ]]; then kill_all pids_in_ns net "/run/netns/$ns"; fi
			if [[ -e $mnt ]]; then kill_all pids_in_ns mnt "$mnt"; fi
			remove_cgroups "kilotun/$cid-n$i"
			if [[ -e $mnt ]]; then
				umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
				rm -f "$mnt"
			fi
			if [[ -e /run/netns/$ns ]]; then ip netns del "$ns" || log "warning: cannot delete netns $ns"; fi
		done
		if [[ -n $cid && -e /run/netns/$cid-sw ]]; then ip netns del "$cid-sw" || true; fi
	fi
	stop_pidfile "$dir/kube-controller-manager.pid" kube-controller-manager
	stop_pidfile "$dir/kube-scheduler.pid" kube-scheduler
	stop_pidfile "$dir/api-relay.pid" socat
	rm -f "$dir/api.sock"
	if [[ -e $dir/env ]] || [[ -e $dir/etcd.pid ]]; then
		bash "$script_dir/kube-down.sh" "$dir" || true
	fi
	if [[ -s $dir/sysctl.saved ]]; then
		sysctl -q -p "$dir/sysctl.saved" >/dev/null 2>&1 || log "warning: cannot restore $(tr '\n' ' ' <"$dir/sysctl.saved")"
		rm -f "$dir/sysctl.saved"
	fi
	if [[ -d $dir/ns ]]; then
		while mountpoint -q "$dir/ns"; do umount "$dir/ns" 2>/dev/null || umount -l "$dir/ns" || break; done
		rmdir "$dir/ns" 2>/dev/null || true
	fi
	rm -f "$state"
}

if [[ $cmd == down ]]; then
	(($# == 2)) || usage
	[[ -d $2 ]] || exit 0
	down "$(cd "$2" && pwd)"
	log "down: $2"
	exit 0
fi
[[ $cmd == up ]] || usage
(($# == 3)) || usage
[[ $3 =~ ^[1-9][0-9]?$ ]] || die "N must be a node count (1-99), not '$3'"
count=$3
mkdir -p "$2"
dir=$(cd "$2" && pwd)
[[ ! -s $dir/cluster.state ]] || die "a cluster is already up in $dir; run $0 down $dir first"
flavor=${KUBE_NODE_FLAVOR:-kubeadm}
[[ $flavor == kubeadm || $flavor == k3s ]] || die "KUBE_NODE_FLAVOR must be kubeadm or k3s, not '$flavor'"
cluster_cidr=${KUBE_CLUSTER_CIDR:-10.244.0.0/16}
read -r -a runtimes <<<"${KUBE_NODE_RUNTIMES:-}"
for runtime in "${runtimes[@]}"; do
	case $runtime in
	runc) ;;
	crun) command -v crun >/dev/null || die "KUBE_NODE_RUNTIMES names crun, which is not installed (package crun)" ;;
	*) die "KUBE_NODE_RUNTIMES: '$runtime' is neither runc nor crun" ;;
	esac
done
# Unix socket paths are limited to 107 bytes.
((${#dir} <= 60)) || die "DIR ($dir) is too long for the unix sockets under it; use a shorter path"

total_start=$SECONDS
phase_start=$SECONDS
phase_name=
phase() {
	if [[ -n $phase_name ]]; then
		log "phase $phase_name: $((SECONDS - phase_start))s"
	fi
	phase_name=$1
	phase_start=$SECONDS
	[[ -z $phase_name ]] || log "phase $phase_name ..."
}

# Any failure from here undoes everything.
on_exit() {
	local rc=$?
	if ((rc != 0)); then
		log "up failed; cleaning up (logs stay in $dir/logs)"
		down "$dir" || true
	fi
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

show_log() {
	log "last lines of $1:"
	tail -n 30 "$1" >&2 || true
}

########################################################################################################
phase tools
for tool in ip nsenter unshare mount umount mountpoint containerd ctr runc iptables curl openssl setsid; do
	command -v "$tool" >/dev/null || die "$tool not found (.ci/run installs iproute2, util-linux, containerd, runc, iptables, curl, openssl)"
done
if ! command -v socat >/dev/null; then
	log "installing socat"
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-get install -y -q --no-install-recommends socat >&2; then
		apt-get update -q >&2 || die "apt-get update failed"
		apt-get install -y -q --no-install-recommends socat >&2 || die "cannot install socat"
	fi
fi
if [[ -n ${KUBE_NODE_BIN_DIR:-} ]]; then
	node_bin=$KUBE_NODE_BIN_DIR
	pause_archive=${KUBE_PAUSE_ARCHIVE:-$node_bin/../images/pause.oci.tar}
	pause_image=${KUBE_PAUSE_IMAGE:-$(cat "$node_bin/../PAUSE_IMAGE" 2>/dev/null || true)}
else
	node_cache=$("$script_dir/kube-node-bins.sh" | tail -n1) || die "scripts/kube-node-bins.sh failed"
	node_bin=$node_cache/bin
	pause_archive=$node_cache/images/pause.oci.tar
	pause_image=$(cat "$node_cache/PAUSE_IMAGE")
fi
for b in kubelet kube-scheduler kube-controller-manager; do
	[[ -x $node_bin/$b ]] || die "$node_bin/$b missing (run scripts/kube-node-bins.sh or set KUBE_NODE_BIN_DIR)"
done
[[ -s $pause_archive && -n $pause_image ]] || die "no pause image archive ($pause_archive) or name"
images=()
for spec in ${KUBE_NODE_IMAGES:-}; do
	[[ -s ${spec%%=*} ]] || die "image archive ${spec%%=*} (KUBE_NODE_IMAGES) missing"
	images+=("$spec")
done

########################################################################################################
phase control-plane
# kube-up.sh stops what it started if it fails; our trap runs kube-down.sh as well. The API
# server calls webhooks at their Service's endpoints (pod IPs, routed below), as there is no
# kube-proxy to make a ClusterIP work on this host.
env_file=$(KUBE_APISERVER_EXTRA_FLAGS="${KUBE_APISERVER_EXTRA_FLAGS:-} --enable-aggregator-routing=true" \
	bash "$script_dir/kube-up.sh" "$dir" | tail -n1) || die "scripts/kube-up.sh failed"
# shellcheck disable=SC1090
source "$env_file"
kubectl() { "$KUBECTL" --kubeconfig "$KUBECONFIG" "$@"; }

# The cluster id names every namespace and cgroup; the state file lets `down` find them.
for ((i = 0; i < 50; i++)); do
	cid=kc$(printf '%04x' $((RANDOM % 65536)))
	[[ ! -e /run/netns/$cid-sw && ! -e /run/netns/$cid-n1 ]] && break
done
printf 'CID=%s\nNODES_CREATED=0\n' "$cid" >"$dir/cluster.state"

# The kernel settings the kubelets change, restored by `down`.
for k in "${KUBELET_SYSCTLS[@]}"; do
	printf '%s = %s\n' "$k" "$(sysctl -n "$k")"
done >"$dir/sysctl.saved"

# The API relay's host side: each connection to DIR/api.sock goes to the API server. Every server
# here is started with setsid (own session) and disowned: `down` stops it, by its pid file.
rm -f "$dir/api.sock"
setsid socat "UNIX-LISTEN:$dir/api.sock,fork,mode=600" "TCP:127.0.0.1:$APISERVER_PORT" \
	</dev/null >"$dir/logs/api-relay.log" 2>&1 &
echo $! >"$dir/api-relay.pid"
disown

ca_data=$(base64 -w0 "$KUBE_CA_FILE")
# kubeadm's kube-proxy ConfigMap: what manifests/kilo-kubeadm.yaml mounts as kg's kubeconfig.
kubectl apply -f - >&2 <<EOF
apiVersion: v1
kind: ConfigMap
metadata:
  name: kube-proxy
  namespace: kube-system
  labels:
    app: kube-proxy
data:
  kubeconfig.conf: |-
    apiVersion: v1
    kind: Config
    clusters:
    - cluster:
        certificate-authority: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt
        server: $APISERVER_URL
      name: default
    contexts:
    - context:
        cluster: default
        namespace: default
        user: default
      name: default
    current-context: default
    users:
    - name: default
      user:
        tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token
EOF

log "starting kube-scheduler and kube-controller-manager"
# No serving ports (--port=0, --secure-port=0): several clusters may share this host's network.
setsid "$node_bin/kube-scheduler" \
	--kubeconfig="$KUBECONFIG" \
	--leader-elect=false \
	--port=0 --secure-port=0 \
	</dev/null >"$dir/logs/kube-scheduler.log" 2>&1 &
echo $! >"$dir/kube-scheduler.pid"
disown
setsid "$node_bin/kube-controller-manager" \
	--kubeconfig="$KUBECONFIG" \
	--leader-elect=false \
	--port=0 --secure-port=0 \
	--allocate-node-cidrs=true \
	--cluster-cidr="$cluster_cidr" \
	--node-cidr-mask-size=24 \
	--service-cluster-ip-range=10.96.0.0/12 \
	--service-account-private-key-file="$dir/pki/sa.key" \
	--root-ca-file="$KUBE_CA_FILE" \
	--use-service-account-credentials=false \
	--node-monitor-period=2s \
	</dev/null >"$dir/logs/kube-controller-manager.log" 2>&1 &
echo $! >"$dir/kube-controller-manager.pid"
disown

########################################################################################################
phase network
# The switch: a bridge in its own namespace, with the nodes' gateway address.
ip netns add "$cid-sw"
ip -n "$cid-sw" link set lo up
ip -n "$cid-sw" link add br0 type bridge
ip -n "$cid-sw" addr add "$SUBNET.1/24" dev br0
ip -n "$cid-sw" link set br0 up
# The host (the API server) on the switch too, at .254, so that it reaches the pods: each
# node's pod CIDR is routed through the node once it has one. The link goes with the switch.
ip link add "${cid}h" type veth peer name host netns "$cid-sw"
ip addr add "$SUBNET.254/24" dev "${cid}h"
ip link set "${cid}h" up
ip -n "$cid-sw" link set host master br0 up

# The mount namespaces are bound to files in DIR/ns, which must be on a private mount.
mkdir -p "$dir/ns"
mountpoint -q "$dir/ns" || mount --bind "$dir/ns" "$dir/ns"
mount --make-private "$dir/ns"

########################################################################################################
phase nodes
# The directories bind-mounted over the host's in a node's mount namespace: node subdirectory
# and mount point.
node_mounts=(
	var-lib-kubelet:/var/lib/kubelet
	cni-conf:/etc/cni/net.d
	cni-bin:/opt/cni/bin
	var-lib-kilo:/var/lib/kilo
	run-wireguard:/run/wireguard
	run-containerd:/run/containerd
	run-netns:/run/netns
	log-pods:/var/log/pods
	log-containers:/var/log/containers
)
if [[ $flavor == k3s ]]; then
	node_mounts+=(
		etc-rancher-k3s:/etc/rancher/k3s
		k3s-cni-conf:/var/lib/rancher/k3s/agent/etc/cni/net.d
	)
	cni_conf_dir=/var/lib/rancher/k3s/agent/etc/cni/net.d
	plugin_dir=
	for d in /usr/lib/cni /opt/cni/bin; do [[ -x $d/bridge ]] && plugin_dir=$d && break; done
	[[ -n $plugin_dir ]] || die "KUBE_NODE_FLAVOR=k3s needs the CNI plugins (package containernetworking-plugins)"
else
	cni_conf_dir=/etc/cni/net.d
fi

node_names=() node_netns=() node_ips=() node_mntns=() node_socks=()
for ((i = 1; i <= count; i++)); do
	ns="$cid-n$i"
	name="$cid-node$i"
	ip_addr="$SUBNET.$((10 + i))"
	nd="$dir/nodes/$i"
	mnt="$dir/ns/$i.mnt"
	log "node $i: $name (netns $ns, $ip_addr)"
	sed -i "s/^NODES_CREATED=.*/NODES_CREATED=$i/" "$dir/cluster.state"

	# Network: eth0 on the switch, default route through its gateway, forwarding on (as a
	# kubeadm node must have it).
	ip netns add "$ns"
	ip -n "$ns" link set lo up
	ip link add "${cid}v$i" netns "$ns" type veth peer name "n$i" netns "$cid-sw"
	ip -n "$ns" link set "${cid}v$i" name eth0
	ip -n "$ns" addr add "$ip_addr/24" dev eth0
	ip -n "$ns" link set eth0 up
	ip -n "$ns" route add default via "$SUBNET.1"
	ip -n "$cid-sw" link set "n$i" master br0 up
	ip netns exec "$ns" sysctl -q -w net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1

	# Mounts: the node's own directories over the host's, in a mount namespace of its own.
	mkdir -p "$nd" "$dir/logs"
	touch "$nd/xtables.lock" "$mnt"
	[[ -e /run/xtables.lock ]] || touch /run/xtables.lock
	unshare --mount="$mnt" --propagation private true
	for m in "${node_mounts[@]}"; do
		mkdir -p "$nd/${m%%:*}" "${m#*:}"
		nsenter --mount="$mnt" mount --bind "$nd/${m%%:*}" "${m#*:}"
	done
	nsenter --mount="$mnt" mount --bind "$nd/xtables.lock" /run/xtables.lock
	if [[ $flavor == k3s ]]; then
		cp -a "$plugin_dir"/. "$nd/cni-bin/"
	fi

	# containerd: its own everything; CRI with cgroupfs, the imported pause image as sandbox
	# image, no OOM score below its own (root here may lack CAP_SYS_RESOURCE); runc or crun
	# behind containerd's runc shim.
	sock="$nd/containerd.sock"
	runtime=${runtimes[i - 1]:-runc}
	runtime_binary=$(command -v "$runtime")
	if [[ $runtime == crun ]] && nsenter --mount="$mnt" mountpoint -q /sys/fs/cgroup/unified; then
		nsenter --mount="$mnt" umount /sys/fs/cgroup/unified
	fi
	log "node $i: containers run with $runtime_binary"
	cat >"$nd/containerd.toml" <<EOF
version = 2
root = "$nd/containerd/root"
state = "$nd/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$pause_image"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "$runtime"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$runtime]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.$runtime.options]
        BinaryName = "$runtime_binary"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/opt/cni/bin"
    conf_dir = "$cni_conf_dir"
EOF
	in_node=(nsenter --mount="$mnt" --net="/run/netns/$ns")
	setsid "${in_node[@]}" containerd --config "$nd/containerd.toml" \
		</dev/null >"$dir/logs/node$i-containerd.log" 2>&1 &
	echo $! >"$nd/containerd.pid"
	disown
	for ((t = 0; t < 100; t++)); do
		ctr --address "$sock" version >/dev/null 2>&1 && break
		alive "$(cat "$nd/containerd.pid")" || {
			show_log "$dir/logs/node$i-containerd.log"
			die "containerd of node $i exited"
		}
		sleep 0.2
	done
	((t < 100)) || {
		show_log "$dir/logs/node$i-containerd.log"
		die "containerd of node $i did not answer on $sock in 20s"
	}
	ctr_node=("${in_node[@]}" ctr --address "$sock" -n k8s.io)
	for spec in "$pause_archive" "${images[@]}"; do
		archive=${spec%%=*}
		out=$("${ctr_node[@]}" images import "$archive" 2>&1) || {
			printf '%s\n' "$out" >&2
			die "node $i: ctr images import $archive failed"
		}
		imported=$(sed -n '/^unpacking /{s/^unpacking \(.*\) (sha256:.*/\1/p;q;}' <<<"$out")
		[[ -n $imported ]] || {
			printf '%s\n' "$out" >&2
			die "node $i: ctr images import $archive named no image (no io.containerd.image.name?)"
		}
		if [[ $spec == *=* && ${spec#*=} != "$imported" ]]; then
			"${ctr_node[@]}" images tag --force "$imported" "${spec#*=}" >/dev/null ||
				die "node $i: cannot tag $imported as ${spec#*=}"
		fi
	done
	# Listed first, then searched: `ctr ... | grep -q` fails under pipefail when grep exits early.
	listed=$("${ctr_node[@]}" images ls -q) || die "node $i: ctr images ls failed"
	grep -qx "$pause_image" <<<"$listed" || die "node $i: $pause_image not imported"

	# The node's side of the API relay.
	setsid nsenter --net="/run/netns/$ns" socat \
		"TCP-LISTEN:$APISERVER_PORT,bind=127.0.0.1,fork,reuseaddr" "UNIX-CONNECT:$dir/api.sock" \
		</dev/null >"$dir/logs/node$i-api-relay.log" 2>&1 &
	echo $! >"$nd/api-relay.pid"
	disown

	# The kubelet's own kubeconfig (the admin's token: the test cluster has no node authorizer).
	(
		umask 077
		cat >"$nd/kubelet.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kilotun
  cluster:
    server: $APISERVER_URL
    certificate-authority-data: $ca_data
users:
- name: kubelet
  user:
    token: $ADMIN_TOKEN
contexts:
- name: kilotun
  context:
    cluster: kilotun
    user: kubelet
current-context: kilotun
EOF
		if [[ $flavor == k3s ]]; then
			# What k3s leaves in /etc/rancher/k3s/k3s.yaml: an admin kubeconfig.
			cp "$nd/kubelet.kubeconfig" "$nd/etc-rancher-k3s/k3s.yaml"
		fi
	)

	# Its cgroups: the kubelet's --cgroup-root must exist in every hierarchy.
	for h in /sys/fs/cgroup/*/; do
		[[ $(stat -f -c %T "$h") == cgroup* ]] || continue
		mkdir -p "${h}kilotun/$cid-n$i" 2>/dev/null || true
	done

	# Notes on the flags: --oom-score-adj=0 (root here may not lower scores); image GC off, as
	# nothing can be pulled again; eviction only when the disk is really full; no read-only or
	# cAdvisor ports; the volume plugin directory under DIR, not /usr/libexec.
	setsid "${in_node[@]}" "$node_bin/kubelet" \
		--kubeconfig="$nd/kubelet.kubeconfig" \
		--hostname-override="$name" \
		--node-ip="$ip_addr" \
		--container-runtime=remote \
		--container-runtime-endpoint="unix://$sock" \
		--runtime-request-timeout=5m \
		--cgroup-driver=cgroupfs \
		--cgroup-root="/kilotun/$cid-n$i" \
		--root-dir=/var/lib/kubelet \
		--pod-infra-container-image="$pause_image" \
		--fail-swap-on=false \
		--oom-score-adj=0 \
		--image-gc-high-threshold=100 \
		--image-gc-low-threshold=99 \
		--eviction-hard='memory.available<64Mi,nodefs.available<1%,imagefs.available<1%' \
		--read-only-port=0 \
		--healthz-bind-address=127.0.0.1 \
		--volume-plugin-dir="$nd/volume-plugins" \
		--node-status-update-frequency=4s \
		--sync-frequency=10s \
		--v=1 \
		</dev/null >"$dir/logs/node$i-kubelet.log" 2>&1 &
	echo $! >"$nd/kubelet.pid"
	disown

	node_names+=("$name")
	node_netns+=("$ns")
	node_ips+=("$ip_addr")
	node_mntns+=("$mnt")
	node_socks+=("$sock")
done

########################################################################################################
phase register
timeout=${KUBE_NODE_READY_TIMEOUT:-120}
for ((i = 1; i <= count; i++)); do
	name=${node_names[i - 1]}
	deadline=$((SECONDS + timeout))
	until [[ -n $(kubectl get node "$name" -o 'jsonpath={.spec.podCIDR}' 2>/dev/null) ]]; do
		alive "$(cat "$dir/nodes/$i/kubelet.pid")" || {
			show_log "$dir/logs/node$i-kubelet.log"
			die "the kubelet of node $i exited"
		}
		if ((SECONDS >= deadline)); then
			show_log "$dir/logs/node$i-kubelet.log"
			show_log "$dir/logs/kube-controller-manager.log"
			die "node $name not registered with a pod CIDR after ${timeout}s"
		fi
		sleep 0.5
	done
	pod_cidr=$(kubectl get node "$name" -o 'jsonpath={.spec.podCIDR}')
	ip route replace "$pod_cidr" via "$SUBNET.$((10 + i))" dev "${cid}h"
	log "node $name registered, pod CIDR $pod_cidr (routed from the host)"
done

########################################################################################################
phase ''
{
	cat "$env_file"
	echo "# Written by scripts/kubelet-cluster.sh; source it."
	for kv in \
		"CLUSTER_ID=$cid" \
		"NODE_COUNT=$count" \
		"NODE_NAMES=${node_names[*]}" \
		"NODE_NETNS=${node_netns[*]}" \
		"NODE_IPS=${node_ips[*]}" \
		"NODE_MNTNS=${node_mntns[*]}" \
		"NODE_CONTAINERD_SOCKS=${node_socks[*]}" \
		"SWITCH_NETNS=$cid-sw" \
		"CLUSTER_CIDR=$cluster_cidr" \
		"PAUSE_IMAGE=$pause_image" \
		"NODE_FLAVOR=$flavor" "NODE_RUNTIMES=${runtimes[*]}"; do
		printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"
	done
} >"$dir/cluster.env"
log "up: $count node(s) ${node_names[*]} in $((SECONDS - total_start))s; source $dir/cluster.env"
printf '%s\n' "$dir/cluster.env"
