# Sourced by tests/helm/install.sh and tests/helm/cozystack.sh after they set `name` (the
# script's name, for its messages) and `repo`, and cd to the repository: what both need before
# their checks. It skips (exit 77) unless root with the cached kube-apiserver v1.20.2 and the
# helm and kubectl of scripts/helm-tools.sh, sets helm, kubectl and the pass and fail counters
# (checks.sh), and gives:
#   work_dir PREFIX          a directory under /tmp in $dir, its API server stopped and the
#                            directory removed on exit (kept after a failure, or with KEEP);
#   start_api_server [FLAGS] etcd and kube-apiserver in $dir (FLAGS: more kube-apiserver
#                            flags), KUBECONFIG exported;
#   k ARGS                   kubectl without its warning about the 1.20 server's version skew.
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
kube_bin="$cache_root/k8s-v1.20.2/bin"

skip() {
	echo "$name: SKIP: $*" >&2
	exit 77
}
[[ $(id -u) == 0 ]] || skip "not root (scripts/kube-up.sh takes its port slot under /run/lock)"
[[ -x $kube_bin/kube-apiserver && -x $kube_bin/etcd ]] ||
	skip "no cached kube-apiserver v1.20.2 in $kube_bin (bash scripts/kube-apiserver.sh builds it)"
if ! bin=$(bash scripts/helm-tools.sh 2>/tmp/kilotun-helm-tools.log | tail -n 1) || [[ ! -x $bin/helm ]]; then
	tail -5 /tmp/kilotun-helm-tools.log >&2
	skip "no helm (scripts/helm-tools.sh failed; see above)"
fi
helm="$bin/helm"
kubectl="$bin/kubectl"

. "$repo/tests/helm/checks.sh"

work_dir() {
	dir=$(mktemp -d "/tmp/kilotun-helm-$1.XXXXXX")
	trap cleanup EXIT
}
cleanup() {
	bash scripts/kube-down.sh "$dir" >/dev/null 2>&1 || true
	rm -f "$dir.up.log"
	if ((failed)) || [[ -n ${KEEP:-} ]]; then
		echo "$name: kept $dir (logs/kube-apiserver.log)"
	else
		rm -rf "$dir"
	fi
}

start_api_server() {
	echo "$name: starting etcd and kube-apiserver v1.20.2 in $dir"
	if ! KUBE_BIN_DIR=$kube_bin KUBE_APISERVER_EXTRA_FLAGS="$*" \
		bash scripts/kube-up.sh "$dir" >"$dir.up.log" 2>&1; then
		cat "$dir.up.log" >&2
		echo "$name: FAIL: scripts/kube-up.sh failed" >&2
		failed=1
		exit 1
	fi
	rm -f "$dir.up.log"
	# shellcheck disable=SC1091
	. "$dir/env"
	export KUBECONFIG
}

k() { "$kubectl" "$@" 2>&1 | grep -v 'exceeds the supported minor version skew'; }
