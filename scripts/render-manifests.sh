#!/usr/bin/env bash
# Render the shipped manifests (manifests/*.yaml) from the Helm chart (charts/kilotun), which is
# their one source: each file is `helm template` of one or two of the chart's templates with
# fixed values (below), the chart's `# Source:` lines dropped, under a header for the file.
#
#   scripts/render-manifests.sh                 # rewrites manifests/*.yaml (and the chart's copy of
#                                               # dashboards/kilotun.json)
#   scripts/render-manifests.sh --check         # exits 1, showing a diff, when a committed file
#                                               # differs from the render; changes nothing
#   scripts/render-manifests.sh --check --manifests DIR   # the same against DIR's *.yaml
#
# manifests/crds.yaml is the chart's crds/peers.yaml as it is (Helm installs crds/ unrendered).
# The chart carries a copy of dashboards/kilotun.json (a chart cannot read files outside its
# directory); this script writes it, and --check compares it too.
# helm: $HELM if set, else the one scripts/helm-tools.sh caches (fetched once).
set -euo pipefail

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$script_dir/.." && pwd)
chart="$repo/charts/kilotun"

log() { printf 'render-manifests.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 2
}

check=false
out_dir="$repo/manifests"
while (($#)); do
	case $1 in
	--check) check=true ;;
	--manifests)
		(($# >= 2)) || die "--manifests needs a directory"
		out_dir=$2
		shift
		;;
	-h | --help)
		sed -n '2,16p' "$0"
		exit 0
		;;
	*) die "unknown argument $1 (see --help)" ;;
	esac
	shift
done
[[ -d $out_dir ]] || die "$out_dir is not a directory"

if [[ -n ${HELM:-} ]]; then
	helm=$HELM
elif command -v helm >/dev/null && [[ $(helm version --short 2>/dev/null) == v4.* ]]; then
	helm=helm
else
	bin=$(bash "$script_dir/helm-tools.sh" | tail -n 1) || die "scripts/helm-tools.sh failed"
	helm="$bin/helm"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# render FILE HEADER TEMPLATE... -- HELM-ARGS...: helm template of TEMPLATEs into $work/FILE.
render() {
	local file=$1 header=$2
	shift 2
	local show=()
	while [[ $1 != -- ]]; do
		show+=(--show-only "templates/$1")
		shift
	done
	shift
	{
		printf '%s\n' "$header"
		"$helm" template kilo "$chart" --namespace kube-system "${show[@]}" "$@" |
			sed -e '/^# Source: /d' | sed -e '1{/^---$/d}'
	} >"$work/$file" || die "rendering $file failed"
}

generated="# Rendered from charts/kilotun by scripts/render-manifests.sh: change the chart, then run it."

render kilo-kubeadm.yaml "$generated
# kilotun's kg on a kubeadm cluster, with the embedded userspace WireGuard engine: no wireguard
# kernel module and no sidecar. kg needs host networking, NET_ADMIN and NET_RAW, and /dev/net/tun.
# Apply together with the CRD and RBAC:
#   kubectl apply -f crds.yaml -f rbac.yaml -f kilo-kubeadm.yaml
# (or: helm install kilo charts/kilotun --namespace kube-system; see docs/helm.md)" \
	daemonset.yaml -- --set variant=kubeadm --set updateStrategy.surge=true

render kilo-k3s.yaml "$generated
# kilotun's kg on a k3s cluster, with the embedded userspace WireGuard engine: no wireguard
# kernel module and no sidecar. kg needs host networking, NET_ADMIN and NET_RAW, and /dev/net/tun.
# k3s ships the bridge, host-local and portmap plugins itself; start k3s with
# --flannel-backend=none so that kg's CNI configuration is the one in use.
# Apply together with the CRD and RBAC:
#   kubectl apply -f crds.yaml -f rbac.yaml -f kilo-k3s.yaml
# (or: helm install kilo charts/kilotun --namespace kube-system --set variant=k3s)" \
	daemonset.yaml -- --set variant=k3s --set updateStrategy.surge=true

render rbac.yaml "$generated" rbac.yaml --

render ipam-rbac.yaml "$generated" ipam-rbac.yaml -- --set ipam=auto

render peer-validation.yaml "$generated
# Validates Peers on CREATE and UPDATE with \`kg webhook\` (AdmissionReview v1 over HTTPS), so a
# Peer with a bad key, CIDR, endpoint or keepalive is refused by the API server instead of being
# ignored by every kg. The TLS certificate is made and the CA bundle patched in by
# kube-webhook-certgen (the two Jobs below), as Kilo does.
#   kubectl apply -f crds.yaml -f peer-validation.yaml" \
	webhook.yaml -- --set webhook.enabled=true --set webhook.namespace=kilo \
	--set webhook.createNamespace=true --set webhook.certificate.source=certgen

render tun-device-plugin.yaml "$generated
# Gives kg (and any other pod) /dev/net/tun through the kubelet's device plugin API, for nodes
# whose container runtime leaves the TUN out of its default devices: runc 1.2.0 to 1.2.3 and
# crun from 2022 to 2025 (Debian bookworm's crun 1.8.1 among them). There kg exits with
# \"/dev/net/tun exists but opening it is denied ... the container runtime's device rules leave it
# out\". \`kg device-plugin\` offers the device as the extended resource squat.ai/tun (the name
# squat/generic-device-plugin users already request), and a container that asks for one gets
# the node created and allowed by the runtime, unprivileged. Not needed where the runtime allows
# the TUN by default (runc 1.1, runc 1.2.4 or later, crun since its 2025 fix, crun #1637).
#
#   kubectl apply -f tun-device-plugin.yaml
#   kubectl -n kube-system patch daemonset kilo -p \\
#     '{\"spec\":{\"template\":{\"spec\":{\"containers\":[{\"name\":\"kilo\",\"resources\":{\"limits\":{\"squat.ai/tun\":\"1\"}}}]}}}}'
#
# (The patch rolls kg out again, node by node; a node whose kubelet does not offer squat.ai/tun
# yet keeps its new kg pod Pending until this DaemonSet's pod there has registered. With the
# chart: --set devicePlugin.enabled=true --set requestTun=true.)" \
	device-plugin.yaml -- --set devicePlugin.enabled=true

render podmonitor.yaml "$generated
# Prometheus Operator: scrape kg's /metrics (kilo_* and kilotun_* series) on every node." \
	podmonitor.yaml -- --set podMonitor.enabled=true

cp "$chart/crds/peers.yaml" "$work/crds.yaml"

files=(crds.yaml rbac.yaml ipam-rbac.yaml kilo-kubeadm.yaml kilo-k3s.yaml peer-validation.yaml tun-device-plugin.yaml podmonitor.yaml)
if $check; then
	differ=0
	for f in "${files[@]}"; do
		if ! diff -u --label "$out_dir/$f (committed)" --label "$f (rendered from charts/kilotun)" \
			"$out_dir/$f" "$work/$f"; then
			differ=1
		fi
	done
	if ! diff -u --label "charts/kilotun/dashboards/kilotun.json (the chart's copy)" \
		--label "dashboards/kilotun.json" "$chart/dashboards/kilotun.json" "$repo/dashboards/kilotun.json"; then
		differ=1
	fi
	if ((differ)); then
		log "the files above differ from what charts/kilotun renders: run scripts/render-manifests.sh"
		exit 1
	fi
	log "${#files[@]} manifests in $out_dir and the chart's dashboard match charts/kilotun"
else
	for f in "${files[@]}"; do
		cp "$work/$f" "$out_dir/$f"
	done
	cp "$repo/dashboards/kilotun.json" "$chart/dashboards/kilotun.json"
	log "wrote ${files[*]} in $out_dir, and charts/kilotun/dashboards/kilotun.json"
fi
