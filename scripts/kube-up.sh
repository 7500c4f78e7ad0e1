#!/usr/bin/env bash
# Start a throwaway Kubernetes v1.20.2 control plane (etcd + kube-apiserver) on loopback for tests.
#
#   scripts/kube-up.sh DIR     # prints (last line of stdout) DIR/env
#   . DIR/env                  # APISERVER_URL, ADMIN_TOKEN, KUBECONFIG, ... (see below)
#   scripts/kube-down.sh DIR   # stops both
#
# Everything lives under DIR:
#   ca.crt                 the cluster CA (it signs the serving certificate; also the client CA)
#   admin.kubeconfig       server https://127.0.0.1:$APISERVER_PORT, CA data, the admin token
#   env                    shell-sourceable exports (below)
#   pki/                   CA key, serving certificate/key, service-account key pair, token file
#   etcd/                  etcd's data directory
#   logs/etcd.log, logs/kube-apiserver.log
#   etcd.pid, kube-apiserver.pid
# Certificates and keys are generated once per DIR (kept on a restart); etcd data persists too.
#
# Only the API server runs: no controller-manager, scheduler or kubelet. Objects that need a
# controller to progress (Pods, Deployments, ServiceAccount token Secrets) stay as written.
# ServiceAccount tokens are available through the TokenRequest API
# (POST .../serviceaccounts/NAME/token).
#
# Environment (all optional):
#   ETCD_PORT, ETCD_PEER_PORT, APISERVER_PORT   fixed loopback ports, all three or none; without
#                                               them a slot of three is claimed (see "Ports")
#   KUBE_UP_LOCK_DIR        where the slots' locks live (default /run/lock/kilotun-kube-up)
#   KUBE_UP_SLOT_WAIT       seconds fixed ports wait for their slot's lock (default 15: a restart's
#                           servers may still be exiting)
#   KUBE_BIN_DIR            directory with kube-apiserver, etcd, kubectl (default: bin/ of the cache
#                           scripts/kube-apiserver.sh prints, building it if needed)
#   KUBE_ADMISSION_PLUGINS  --enable-admission-plugins (default below)
#   KUBE_READY_TIMEOUT      seconds to wait for /readyz (default 60)
#   KUBE_APISERVER_EXTRA_FLAGS  more kube-apiserver flags, split on whitespace (e.g.
#                           --watch-cache=false, so watches are served by etcd and see its
#                           compactions as 410 Gone)
#
# DIR/env exports APISERVER_URL, APISERVER_PORT, ADMIN_TOKEN, KUBECONFIG, KUBE_CA_FILE, ETCD_URL,
# ETCD_PORT, ETCD_PID, APISERVER_PID, KUBE_BIN_DIR and KUBECTL.
set -euo pipefail

log() { printf 'kube-up.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

(($# == 1)) || die "usage: $0 DIR"
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$1"
dir=$(cd "$1" && pwd)
for tool in openssl curl base64 setsid; do
	command -v "$tool" >/dev/null || die "$tool not found"
done

# True while pid $1 runs program $2: it exists, is not a zombie (where PID 1 does not reap, an exited
# server can linger as one) and its comm is $2 (the pid was not reused by something else).
running() {
	local state
	state=$(awk '{ sub(/.*\) /, ""); print $1 }' "/proc/$1/stat" 2>/dev/null) || return 1
	[[ -n $state && $state != Z && $(cat "/proc/$1/comm" 2>/dev/null) == "$2" ]]
}

# Refuse to start a second control plane over a running one in the same DIR.
for name in etcd kube-apiserver; do
	if [[ -s $dir/$name.pid ]] && running "$(cat "$dir/$name.pid")" "$name"; then
		die "$name already running in $dir (pid $(cat "$dir/$name.pid")); run scripts/kube-down.sh $dir first"
	fi
done

if [[ -n ${KUBE_BIN_DIR:-} ]]; then
	bin=$KUBE_BIN_DIR
else
	bin="$("$script_dir/kube-apiserver.sh" | tail -n1)/bin"
fi
for b in kube-apiserver etcd kubectl; do
	[[ -x $bin/$b ]] || die "$bin/$b missing (run scripts/kube-apiserver.sh or set KUBE_BIN_DIR)"
done
kubectl="$bin/kubectl"

########################################################################################################
# Ports.
# True if a socket listens on local TCP port $1 (state 0A). A port given explicitly (a restart on
# the same ports) only needs this to be false: connections the killed server left in TIME_WAIT
# do not stop etcd or kube-apiserver from binding it (both set SO_REUSEADDR).
port_listening() {
	local hex f tables=()
	hex=$(printf ':%04X' "$1")
	for f in /proc/net/tcp /proc/net/tcp6; do [[ -r $f ]] && tables+=("$f"); done
	awk -v h="$hex" 'FNR > 1 && substr($2, length($2) - 4) == h && $4 == "0A" { found = 1 } END { exit !found }' \
		"${tables[@]}"
}
# Ports come in slots, each held by a lock, never guessed free: slot N is etcd on 20000+3N, its
# peer listener on 20001+3N and kube-apiserver on 20002+3N (N < 3000, below Linux's ephemeral
# range, 32768+, so no outgoing connection takes one). A slot is claimed with flock(1) on
# $KUBE_UP_LOCK_DIR/slot-N (default /run/lock/kilotun-kube-up) through a file descriptor that
# etcd and kube-apiserver inherit: the lock lives as long as either server does, so no other
# control plane started by this script can pick its ports while it runs or between the pick and
# the bind. Explicit ports (a restart on the same ports) claim their own slot and fail if another
# live control plane holds it.
slot_base=20000
slots=3000
lock_dir=${KUBE_UP_LOCK_DIR:-/run/lock/kilotun-kube-up}
mkdir -p "$lock_dir" 2>/dev/null || lock_dir=${TMPDIR:-/tmp}/kilotun-kube-up
mkdir -p "$lock_dir"
slot_fd=
# Claims slot $1, waiting up to $2 seconds for it (default: not at all); on success the lock's
# descriptor is in $slot_fd, left open for the servers.
claim_slot() {
	local fd wait=${2:-0}
	exec {fd}>"$lock_dir/slot-$1"
	if { ((wait == 0)) && flock -n "$fd"; } || { ((wait > 0)) && flock -w "$wait" "$fd"; }; then
		slot_fd=$fd
		return 0
	fi
	exec {fd}>&-
	return 1
}
# The processes that hold slot $1's lock file open, as "pid (comm)", for an error message.
slot_holders() {
	local fd target out=()
	for fd in /proc/[0-9]*/fd/*; do
		target=$(readlink "$fd" 2>/dev/null) || continue
		[[ $target == "$lock_dir/slot-$1" ]] || continue
		fd=${fd#/proc/}
		out+=("${fd%%/*} ($(cat "/proc/${fd%%/*}/comm" 2>/dev/null))")
	done
	printf '%s\n' "${out[@]:-none found}" | sort -u | paste -sd, -
}
if [[ -n ${ETCD_PORT:-}${ETCD_PEER_PORT:-}${APISERVER_PORT:-} ]]; then
	etcd_port=${ETCD_PORT:-}
	etcd_peer_port=${ETCD_PEER_PORT:-}
	apiserver_port=${APISERVER_PORT:-}
	for p in "$etcd_port" "$etcd_peer_port" "$apiserver_port"; do
		if ! [[ $p =~ ^[0-9]+$ ]] || ((p < 1 || p > 65535)); then
			die "ETCD_PORT, ETCD_PEER_PORT and APISERVER_PORT go together; got '$etcd_port' '$etcd_peer_port' '$apiserver_port'"
		fi
	done
	slot=$(((etcd_port - slot_base) / 3))
	if ((etcd_port >= slot_base && slot < slots && etcd_port == slot_base + 3 * slot &&
		etcd_peer_port == etcd_port + 1 && apiserver_port == etcd_port + 2)); then
		# A restart on the same ports: the servers just stopped may still be letting go of
		# the lock (their last descriptors close as they exit), so it is waited for a while.
		claim_slot "$slot" "${KUBE_UP_SLOT_WAIT:-15}" ||
			die "ports $etcd_port-$apiserver_port (slot $slot) are held by another control plane ($lock_dir/slot-$slot, held by: $(slot_holders "$slot"))"
	fi
else
	start=$((RANDOM % slots))
	for ((i = 0; i < slots; i++)); do
		slot=$(((start + i) % slots))
		claim_slot "$slot" || continue
		etcd_port=$((slot_base + 3 * slot))
		etcd_peer_port=$((etcd_port + 1))
		apiserver_port=$((etcd_port + 2))
		# Something other than this script may listen there: try the next slot.
		if port_listening "$etcd_port" || port_listening "$etcd_peer_port" || port_listening "$apiserver_port"; then
			exec {slot_fd}>&-
			slot_fd=
			continue
		fi
		break
	done
	[[ -n $slot_fd ]] || die "no free slot of ports in $lock_dir"
fi
for p in "$etcd_port" "$etcd_peer_port" "$apiserver_port"; do
	! port_listening "$p" || die "port $p is in use"
done

########################################################################################################
# PKI. openssl only; every key stays under DIR.
pki="$dir/pki"
mkdir -p "$pki" "$dir/logs" "$dir/etcd"
chmod 0700 "$pki" "$dir/etcd"
if [[ ! -s $pki/sa.pub ]]; then
	log "generating certificates and keys in $pki"
	(
		cd "$pki"
		umask 077
		# The cluster CA.
		openssl req -x509 -newkey rsa:2048 -nodes -sha256 -days 3650 \
			-keyout ca.key -out ca.crt -subj "/CN=kilotun-test-ca" \
			-addext "basicConstraints=critical,CA:TRUE" \
			-addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
		# The serving certificate: every name a client might use for the API server, on loopback
		# or from inside the (absent) cluster network (10.96.0.1 is the `kubernetes` Service's
		# ClusterIP for --service-cluster-ip-range=10.96.0.0/12).
		openssl req -newkey rsa:2048 -nodes -sha256 \
			-keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver" 2>/dev/null
		cat >apiserver.ext <<-'EOF'
			basicConstraints = critical, CA:FALSE
			keyUsage = critical, digitalSignature, keyEncipherment
			extendedKeyUsage = serverAuth
			subjectAltName = IP:127.0.0.1, IP:10.96.0.1, DNS:localhost, DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local
		EOF
		openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -sha256 -days 3650 \
			-set_serial "0x$(openssl rand -hex 16)" -extfile apiserver.ext -out apiserver.crt 2>/dev/null
		rm -f apiserver.csr apiserver.ext
		# The service-account key pair: the private key signs tokens (TokenRequest), the public
		# key verifies them.
		openssl genrsa -out sa.key 2048 2>/dev/null
		openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
		# Static token of the admin: group system:masters is bound to cluster-admin and bypasses
		# RBAC. Format: token,user,uid,"group,...".
		printf '%s,kilotun-admin,kilotun-admin,"system:masters"\n' "$(openssl rand -hex 32)" >tokens.csv
	) || die "certificate generation failed"
	cp "$pki/ca.crt" "$dir/ca.crt"
	chmod 0644 "$dir/ca.crt"
fi
admin_token=$(cut -d, -f1 "$pki/tokens.csv")

########################################################################################################
# Processes. Started with setsid (own session: a Ctrl-C or a killed process group of the caller
# does not take them down; kube-down.sh does), stdin from /dev/null and output to log files (a
# caller capturing this script's output is not held open by them). setsid execs in place, so $!
# is the server's own pid.
started=()
on_exit() {
	local rc=$? pid
	if ((rc != 0)) && ((${#started[@]})); then
		log "startup failed; stopping what was started"
		for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
		# They are still our children: wait for them to exit, so a failed start leaves nothing.
		for pid in "${started[@]}"; do wait "$pid" 2>/dev/null || true; done
		rm -f "$dir/etcd.pid" "$dir/kube-apiserver.pid"
	fi
}
trap on_exit EXIT

# Last lines of a log, for error messages.
show_log() {
	log "last lines of $1:"
	tail -n 25 "$1" >&2 || true
}

etcd_url="http://127.0.0.1:$etcd_port"
log "starting etcd on $etcd_url (peer port $etcd_peer_port)"
setsid "$bin/etcd" \
	--name=kilotun \
	--data-dir="$dir/etcd" \
	--listen-client-urls="$etcd_url" \
	--advertise-client-urls="$etcd_url" \
	--listen-peer-urls="http://127.0.0.1:$etcd_peer_port" \
	--initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer_port" \
	--initial-cluster="kilotun=http://127.0.0.1:$etcd_peer_port" \
	--logger=zap --log-outputs=stderr \
	</dev/null >"$dir/logs/etcd.log" 2>&1 &
etcd_pid=$!
started+=("$etcd_pid")
echo "$etcd_pid" >"$dir/etcd.pid"

for ((i = 0; i < 100; i++)); do
	if curl -sf --max-time 2 "$etcd_url/health" 2>/dev/null | grep -q '"health":"true"'; then
		break
	fi
	kill -0 "$etcd_pid" 2>/dev/null || {
		show_log "$dir/logs/etcd.log"
		die "etcd exited"
	}
	sleep 0.2
done
((i < 100)) || {
	show_log "$dir/logs/etcd.log"
	die "etcd not healthy after 20s"
}

apiserver_url="https://127.0.0.1:$apiserver_port"
admission=${KUBE_ADMISSION_PLUGINS:-NamespaceLifecycle,ServiceAccount,MutatingAdmissionWebhook,ValidatingAdmissionWebhook}
log "starting kube-apiserver on $apiserver_url"
# Notes on the flags:
# --endpoint-reconciler-type=none  there is a single API server and nothing to reconcile.
# --disable-admission-plugins  of the plugins 1.20 enables by default, these two change objects
#                        in ways only absent controllers would undo: TaintNodesByCondition taints
#                        every new Node not-ready, StorageObjectInUseProtection puts finalizers on
#                        PVCs/PVs.
# --service-account-*/--api-audiences  the TokenRequest API needs an issuer and a signing key.
setsid "$bin/kube-apiserver" \
	--etcd-servers="$etcd_url" \
	--bind-address=127.0.0.1 \
	--advertise-address=127.0.0.1 \
	--secure-port="$apiserver_port" \
	--tls-cert-file="$pki/apiserver.crt" \
	--tls-private-key-file="$pki/apiserver.key" \
	--client-ca-file="$pki/ca.crt" \
	--token-auth-file="$pki/tokens.csv" \
	--authorization-mode=RBAC \
	--service-account-key-file="$pki/sa.pub" \
	--service-account-signing-key-file="$pki/sa.key" \
	--service-account-issuer=https://kubernetes.default.svc \
	--api-audiences=https://kubernetes.default.svc \
	--service-cluster-ip-range=10.96.0.0/12 \
	--endpoint-reconciler-type=none \
	--enable-admission-plugins="$admission" \
	--disable-admission-plugins=TaintNodesByCondition,StorageObjectInUseProtection \
	--profiling=false \
	${KUBE_APISERVER_EXTRA_FLAGS:-} \
	</dev/null >"$dir/logs/kube-apiserver.log" 2>&1 &
apiserver_pid=$!
started+=("$apiserver_pid")
echo "$apiserver_pid" >"$dir/kube-apiserver.pid"

timeout=${KUBE_READY_TIMEOUT:-60}
deadline=$((SECONDS + timeout))
until curl -sf --max-time 2 --cacert "$dir/ca.crt" -H "Authorization: Bearer $admin_token" \
	"$apiserver_url/readyz" >/dev/null 2>&1; do
	kill -0 "$apiserver_pid" 2>/dev/null || {
		show_log "$dir/logs/kube-apiserver.log"
		die "kube-apiserver exited"
	}
	if ((SECONDS >= deadline)); then
		curl -s --max-time 2 --cacert "$dir/ca.crt" -H "Authorization: Bearer $admin_token" \
			"$apiserver_url/readyz?verbose" >&2 || true
		show_log "$dir/logs/kube-apiserver.log"
		die "kube-apiserver not ready after ${timeout}s"
	fi
	sleep 0.5
done
log "kube-apiserver ready after $((SECONDS - deadline + timeout))s"

########################################################################################################
# Client configuration.
umask 077
cat >"$dir/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kilotun
  cluster:
    server: $apiserver_url
    certificate-authority-data: $(base64 -w0 "$dir/ca.crt")
users:
- name: kilotun-admin
  user:
    token: $admin_token
contexts:
- name: kilotun
  context:
    cluster: kilotun
    user: kilotun-admin
current-context: kilotun
EOF
{
	echo "# Written by scripts/kube-up.sh; source it."
	for kv in \
		"APISERVER_URL=$apiserver_url" \
		"APISERVER_PORT=$apiserver_port" \
		"ADMIN_TOKEN=$admin_token" \
		"KUBECONFIG=$dir/admin.kubeconfig" \
		"KUBE_CA_FILE=$dir/ca.crt" \
		"ETCD_URL=$etcd_url" \
		"ETCD_PORT=$etcd_port" \
		"ETCD_PID=$etcd_pid" \
		"APISERVER_PID=$apiserver_pid" \
		"KUBE_BIN_DIR=$bin" \
		"KUBECTL=$kubectl"; do
		printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"
	done
} >"$dir/env"
umask 022

########################################################################################################
# The API server creates default, kube-system, kube-public and kube-node-lease itself, shortly
# after it is ready; wait briefly for them and create any of the two that is still missing.
for ns in default kube-system; do
	for ((i = 0; i < 20; i++)); do
		"$kubectl" --kubeconfig "$dir/admin.kubeconfig" get namespace "$ns" >/dev/null 2>&1 && break
		sleep 0.25
	done
	if ((i == 20)); then
		log "namespace $ns missing; creating it"
		"$kubectl" --kubeconfig "$dir/admin.kubeconfig" create namespace "$ns" >&2 ||
			"$kubectl" --kubeconfig "$dir/admin.kubeconfig" get namespace "$ns" >/dev/null ||
			die "cannot create namespace $ns"
	fi
done

log "up: $apiserver_url (etcd $etcd_url, pids $etcd_pid $apiserver_pid); source $dir/env"
printf '%s\n' "$dir/env"
