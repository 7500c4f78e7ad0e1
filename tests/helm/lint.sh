#!/usr/bin/env bash
# The chart (charts/kilotun) with the real helm (v4.1.4, from scripts/helm-tools.sh), no cluster:
#   1. `helm lint --strict` and `helm template` over a matrix of values (each variant, the
#      webhook with each certificate source, the device plugin, the monitors, the dashboard,
#      post-quantum, the WireGuard modes, leases, Cilium/flannel compatibility); every kg flag
#      the chart renders is one `kg --help` lists (target/ci/kg, when built);
#   2. the schema refuses each bad value with helm's error naming it;
#   3. contradicting values fail the render with a message naming them;
#   4. `scripts/render-manifests.sh --check` passes, and a planted drift (a copy of the manifests
#      with one line changed) is caught, with the diff shown;
#   5. docs/helm.md's values table is what scripts/helm-values-doc.sh prints.
#
#   bash tests/helm/lint.sh        # exit 0: all passed; 1: a check failed; 77: no helm
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
chart="$repo/charts/kilotun"
cd "$repo"
start=$SECONDS

if [[ -n ${HELM:-} ]]; then
	helm=$HELM
else
	if ! bin=$(bash scripts/helm-tools.sh 2>/tmp/kilotun-helm-tools.log | tail -n 1) || [[ ! -x $bin/helm ]]; then
		tail -5 /tmp/kilotun-helm-tools.log >&2
		echo "lint.sh: SKIP: no helm (scripts/helm-tools.sh failed; see above)" >&2
		exit 77
	fi
	helm="$bin/helm"
fi
export HELM=$helm
echo "lint.sh: $("$helm" version --short) at $helm"

. "$repo/tests/helm/checks.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# kg's flags (and its subcommands'), from --help, when a kg binary is there (no build here).
kg=
for candidate in "$repo/target/ci/kg" "$repo/target/release/kg" "$repo/target/debug/kg"; do
	if [[ -x $candidate ]] && "$candidate" --help >/dev/null 2>&1; then
		kg=$candidate
		break
	fi
done
declare -A kg_flags=()
if [[ -n $kg ]]; then
	kg_flags[agent]=$("$kg" --help 2>/dev/null | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u)
	for sub in webhook device-plugin; do
		kg_flags[$sub]=$("$kg" "$sub" --help 2>/dev/null | grep -oE -- '--[a-z][a-z0-9-]*' | sort -u)
	done
	echo "lint.sh: kg's flags from $kg --help, webhook --help, device-plugin --help"
else
	echo "lint.sh: no kg binary (target/ci/kg): kg's flags are not checked"
fi

echo "== 1. helm lint --strict and helm template over the values matrix"
matrix=(
	"defaults (kubeadm)|"
	"k3s|--set variant=k3s"
	"surge off (Kubernetes before 1.22)|--set updateStrategy.surge=false"
	"surge on|--set updateStrategy.surge=true"
	"webhook, certgen Jobs|--set webhook.enabled=true --set webhook.certificate.source=certgen --set webhook.namespace=kilo --set webhook.createNamespace=true"
	"webhook, certificate made by helm|--set webhook.enabled=true --set webhook.certificate.source=helm"
	"webhook, existing Secret|--set webhook.enabled=true --set webhook.certificate.source=secret --set webhook.certificate.secretName=my-tls --set webhook.certificate.caBundle=Q0EK"
	"webhook, Secret with cert-manager's CA injection|--set webhook.enabled=true --set webhook.certificate.source=secret --set-string webhook.annotations.cert-manager\.io/inject-ca-from=kube-system/peer-validation"
	"device plugin|--set devicePlugin.enabled=true"
	"device plugin and kg asking for squat.ai/tun|--set devicePlugin.enabled=true --set requestTun=true"
	"external device plugin|--set devicePlugin.external=true --set requestTun=true"
	"PodMonitor|--set podMonitor.enabled=true --set podMonitor.labels.release=prometheus"
	"ServiceMonitor|--set serviceMonitor.enabled=true"
	"dashboard|--set dashboard.enabled=true --set dashboard.namespace=monitoring"
	"post-quantum|--set postQuantum=true"
	"kernel WireGuard|--set wireguard=kernel"
	"auto WireGuard|--set wireguard=auto"
	"Kilo's leader rule|--set leaderElection=kilo"
	"leases, 3 leaders per location|--set leaderElection=lease --set leadersPerLocation=3"
	"full mesh|--set meshGranularity=full"
	"cross mesh, Cozystack's CIDRs|--set meshGranularity=cross --set transitCIDR=100.66.0.0/16 --set podCIDR=10.244.0.0/16 --set serviceCIDR=10.96.0.0/16"
	"dual-stack CIDRs|--set transitCIDR=fd00:66::/64 --set podCIDR=10.244.0.0/16\,fd00:10:244::/56 --set serviceCIDR=10.96.0.0/16\,fd00:10:96::/112"
	"Cilium (as docs/cni-cilium.md)|--set compatibility=cilium --set cni.enabled=false --set local=false --set ipam=cilium"
	"flannel (as docs/cni-flannel.md)|--set compatibility=flannel --set cni.enabled=false --set variant=k3s"
	"Calico IPAM|--set ipam=calico --set cni.enabled=false"
	"ipam auto|--set ipam=auto"
	"MTU, port, encapsulation, clean-up, log level, extra args|--set mtu=1380 --set port=51821 --set encapsulate=crosssubnet --set cleanUpInterface=true --set logLevel=debug --set internalCIDRs[0]=192.168.0.0/16 --set extraArgs[0]=--topology-label=zone"
	"placement, resources, priority|--set nodeSelector.kubernetes\.io/os=linux --set priorityClassName=high --set resources.limits.memory=256Mi --set tolerations=null"
	"Cozystack's settings (docs/helm.md's takeover)|--namespace cozy-kilo --set apiServer=https://127.0.0.1:7445 --set transitCIDR=100.66.0.0/16 --set meshGranularity=location --set compatibility=cilium --set cni.enabled=false --set encapsulate=crosssubnet --set local=false --set podAnnotations.team=net"
	"another namespace and name|--namespace kilo-system --set name=kilotun --set commonLabels.team=net"
	"everything at once|--set variant=k3s --set webhook.enabled=true --set webhook.certificate.source=helm --set devicePlugin.enabled=true --set requestTun=true --set podMonitor.enabled=true --set dashboard.enabled=true --set postQuantum=true --set wireguard=auto --set ipam=auto"
)
for entry in "${matrix[@]}"; do
	name=${entry%%|*}
	read -r -a args <<<"${entry#*|}"
	ns=(--namespace kube-system)
	[[ " ${args[*]} " == *" --namespace "* ]] && ns=()
	if ! out=$("$helm" lint --strict "$chart" "${ns[@]}" "${args[@]}" 2>&1); then
		bad "$name: helm lint --strict failed: $out"
		continue
	fi
	if ! "$helm" template kilo "$chart" "${ns[@]}" "${args[@]}" >"$work/render.yaml" 2>"$work/err"; then
		bad "$name: helm template failed: $(cat "$work/err")"
		continue
	fi
	docs=$(grep -c '^kind: ' "$work/render.yaml")
	# Every kg command line: "SUBCOMMAND --flag" for each flag (SUBCOMMAND "-" for the agent).
	flags=$(awk '
		/- \/usr\/local\/bin\/kg$/ { kg = 1; sub_ = "-"; first = 1; next }
		kg && /^ *args:$/ { next }
		kg && /^ *#/ { next }
		kg && /^ *- / {
			arg = $0; sub(/^ *- "?/, "", arg)
			if (first && arg !~ /^--/) { sub_ = arg; first = 0; next }
			first = 0
			if (match(arg, /^--[a-z][a-z0-9-]*/)) print sub_ " " substr(arg, 1, RLENGTH)
			next
		}
		kg { kg = 0 }' "$work/render.yaml" | sort -u)
	unknown=
	if [[ -n $kg ]]; then
		while read -r sub flag; do
			[[ -n $flag ]] || continue
			[[ $sub == - ]] && sub=agent
			grep -qxF -- "$flag" <<<"${kg_flags[$sub]:-}" || unknown+=" kg $sub $flag"
		done <<<"$flags"
	fi
	if [[ -n $unknown ]]; then
		bad "$name: --help does not list:$unknown"
	else
		ok "$name: lint --strict clean, $docs objects, kg flags: $(awk '{print ($1 == "-" ? "" : $1 " ") $2}' <<<"$flags" | paste -sd, -)"
	fi
done

# A few renders checked for what they must hold.
expect_render() {
	local name=$1 pattern=$2
	shift 2
	if "$helm" template kilo "$chart" --namespace kube-system "$@" 2>&1 | grep -qE -- "$pattern"; then
		ok "$name"
	else
		bad "$name: no line matching /$pattern/ in the render of $*"
	fi
}
expect_render "surge off renders maxUnavailable 1 and no maxSurge" '^      maxUnavailable: 1$' --set updateStrategy.surge=false
expect_render "surge auto on 1.21 renders one node at a time" '^      maxUnavailable: 1$' --kube-version 1.21.0
expect_render "surge auto on 1.22 renders maxSurge 1" '^      maxSurge: 1$' --kube-version 1.22.0
expect_render "requestTun puts squat.ai/tun in kg's limits" 'squat.ai/tun: "1"' --set devicePlugin.enabled=true --set requestTun=true
expect_render "the helm certificate source fills caBundle" '^      caBundle: [A-Za-z0-9+/=]{100,}$' --set webhook.enabled=true --set webhook.certificate.source=helm
expect_render "transitCIDR becomes --subnet" '^            - --subnet=100.66.0.0/16$' --set transitCIDR=100.66.0.0/16
expect_render "podCIDR becomes --service-cidr" '^            - --service-cidr=10.244.0.0/16$' --set podCIDR=10.244.0.0/16
expect_render "ipam other than node adds the kilo-ipam ClusterRole" '^  name: kilo-ipam$' --set ipam=auto
expect_render "apiServer makes kg's kubeconfig ConfigMap for that server" '^          server: "https://127.0.0.1:7445"$' --set apiServer=https://127.0.0.1:7445
expect_render "apiServer's kubeconfig is kg's volume" '^            name: kilo-kubeconfig$' --set apiServer=https://127.0.0.1:7445
expect_render "apiServer on k3s: kg reads the chart's kubeconfig, not k3s's" '^            - --kubeconfig=/etc/kubernetes/kubeconfig$' --set variant=k3s --set apiServer=https://127.0.0.1:7445
expect_render "another apiServer rolls kg's pods (a checksum in the pod template)" '^        checksum/kubeconfig: "[0-9a-f]{64}"$' --set apiServer=https://127.0.0.1:7445
expect_render "the dashboard ConfigMap holds dashboards/kilotun.json" '"uid": "kilotun"' --set dashboard.enabled=true

echo "== 2. the schema refuses bad values, naming them"
# name|helm's text naming the value|--set arguments
refusals=(
	"unknown granularity|at '/meshGranularity': value must be one of|--set meshGranularity=bogus"
	"malformed transitCIDR|at '/transitCIDR': '10.4.0.0/33' does not match pattern|--set transitCIDR=10.4.0.0/33"
	"transitCIDR not a CIDR|at '/transitCIDR': '10.4.0.0' does not match pattern|--set transitCIDR=10.4.0.0"
	"malformed podCIDR|at '/podCIDR': '10.244.0.0/16,nope' does not match pattern|--set podCIDR=10.244.0.0/16\,nope"
	"malformed serviceCIDR|at '/serviceCIDR': '300.96.0.0/12' does not match pattern|--set serviceCIDR=300.96.0.0/12"
	"malformed internal CIDR|at '/internalCIDRs/0'|--set internalCIDRs[0]=eth0"
	"negative leaders per location|at '/leadersPerLocation': minimum: got -1, want 1|--set leadersPerLocation=-1"
	"17 leaders per location|at '/leadersPerLocation': maximum: got 17, want 16|--set leadersPerLocation=17"
	"negative webhook replicas|at '/webhook/replicas': minimum: got -2, want 1|--set webhook.replicas=-2"
	"negative maxUnavailable|at '/updateStrategy/maxUnavailable': minimum: got -1, want 1|--set updateStrategy.maxUnavailable=-1"
	"MTU too small|at '/mtu'|--set mtu=100"
	"MTU not a number|at '/mtu'|--set mtu=big"
	"port 0|at '/port': minimum: got 0, want 1|--set port=0"
	"unknown WireGuard mode|at '/wireguard': value must be one of 'embedded', 'kernel', 'auto'|--set wireguard=userspace"
	"unknown IPAM|at '/ipam': value must be one of|--set ipam=flannel"
	"unknown leader election|at '/leaderElection': value must be one of 'lease', 'kilo'|--set leaderElection=raft"
	"unknown compatibility|at '/compatibility': value must be one of|--set compatibility=calico"
	"unknown variant|at '/variant': value must be one of 'kubeadm', 'k3s'|--set variant=kind"
	"unknown surge setting|at '/updateStrategy/surge': value must be one of 'auto', true, false|--set updateStrategy.surge=maybe"
	"unknown certificate source|at '/webhook/certificate/source': value must be one of|--set webhook.certificate.source=vault"
	"post-quantum not a boolean|at '/postQuantum': got string, want boolean|--set-string postQuantum=yes"
	"apiServer not an https URL|at '/apiServer': '127.0.0.1:7445' does not match pattern|--set apiServer=127.0.0.1:7445"
	"a misspelt value|at '': additional properties 'meshGranularty' not allowed|--set meshGranularty=full"
	"an extra arg that is not a flag|at '/extraArgs/0'|--set extraArgs[0]=full"
)
# `refused_by_template ENTRY`: ENTRY is "name|what the error must say|helm arguments"; helm
# template must fail saying it. Sets name, want, args and out for the caller.
refused_by_template() {
	IFS='|' read -r name want rest <<<"$1"
	read -r -a args <<<"$rest"
	if out=$("$helm" template kilo "$chart" --namespace kube-system "${args[@]}" 2>&1 >/dev/null); then
		bad "$name: helm template accepted ${args[*]}"
	elif [[ $out == *"$want"* ]]; then
		ok "$name: $(grep -F -- "$want" <<<"$out" | head -1 | sed 's/^ *- //' | cut -c1-110)"
	else
		bad "$name: refused, but the error does not say \"$want\": $out"
	fi
}
for entry in "${refusals[@]}"; do
	refused_by_template "$entry"
	# helm install refuses it the same way (no cluster needed: --dry-run=client).
	if out=$("$helm" install kilo "$chart" --dry-run=client --namespace kube-system "${args[@]}" 2>&1 >/dev/null); then
		bad "$name: helm install --dry-run accepted ${args[*]}"
	elif [[ $out != *"$want"* ]]; then
		bad "$name: helm install's error does not say \"$want\": $out"
	fi
done

echo "== 3. contradicting values fail the render, naming them"
contradictions=(
	"webhook with no certificate source|webhook.enabled=true needs a certificate: set webhook.certificate.source|--set webhook.enabled=true"
	"webhook Secret without a name|webhook.certificate.source=secret needs webhook.certificate.secretName|--set webhook.enabled=true --set webhook.certificate.source=secret --set webhook.certificate.secretName="
	"webhook Secret without a CA bundle|webhook.certificate.source=secret needs webhook.certificate.caBundle|--set webhook.enabled=true --set webhook.certificate.source=secret"
	"squat.ai/tun with the device plugin off|requestTun=true asks kg's container for squat.ai/tun, which nothing offers with devicePlugin.enabled=false|--set requestTun=true"
	"squat.ai/tun in resources with the plugin off|resources.limits asks kg's container for squat.ai/tun, which nothing offers with devicePlugin.enabled=false|--set resources.limits.squat\.ai/tun=1"
	"transitCIDR inside podCIDR|transitCIDR 10.244.8.0/24 overlaps podCIDR 10.244.0.0/16|--set transitCIDR=10.244.8.0/24 --set podCIDR=10.244.0.0/16"
	"transitCIDR around serviceCIDR|transitCIDR 10.0.0.0/8 overlaps serviceCIDR 10.96.0.0/12|--set transitCIDR=10.0.0.0/8 --set serviceCIDR=10.96.0.0/12"
	"kg's default subnet inside podCIDR|transitCIDR (empty: kg's default --subnet 10.4.0.0/16) overlaps podCIDR 10.0.0.0/8|--set podCIDR=10.0.0.0/8"
	"IPv6 transitCIDR inside the IPv6 podCIDR|transitCIDR fd00:10:244:1::/64 overlaps podCIDR fd00:10:244::/56|--set transitCIDR=fd00:10:244:1::/64 --set podCIDR=10.244.0.0/16\,fd00:10:244::/56"
	"compatibility with kg's CNI on|compatibility=cilium runs kg beside cilium's own CNI, but cni.enabled=true|--set compatibility=cilium"
	"Calico IPAM with kg's CNI on|ipam=calico reads the pod ranges of another CNI, but cni.enabled=true|--set ipam=calico"
	"PodMonitor and ServiceMonitor|podMonitor.enabled=true and serviceMonitor.enabled=true would scrape every kg twice|--set podMonitor.enabled=true --set serviceMonitor.enabled=true"
)
for entry in "${contradictions[@]}"; do
	refused_by_template "$entry"
done
# No false alarm: adjacent ranges and the other family do not overlap.
for args in "--set transitCIDR=10.245.0.0/16 --set podCIDR=10.244.0.0/16" \
	"--set transitCIDR=fd00:66::/64 --set podCIDR=10.244.0.0/16\,fd00:10:244::/56 --set serviceCIDR=10.96.0.0/12"; do
	read -r -a a <<<"$args"
	if "$helm" template kilo "$chart" --namespace kube-system "${a[@]}" >/dev/null 2>"$work/err"; then
		ok "no overlap reported for $args"
	else
		bad "an overlap reported for $args: $(cat "$work/err")"
	fi
done

echo "== 4. the shipped manifests are the chart's render"
if out=$(bash scripts/render-manifests.sh --check 2>&1); then
	ok "scripts/render-manifests.sh --check: $(tail -1 <<<"$out" | sed 's/^render-manifests.sh: //')"
else
	bad "scripts/render-manifests.sh --check: $out"
fi
cp -r manifests "$work/drift"
sed -i 's/--listen=:1107/--listen=:1108/' "$work/drift/kilo-k3s.yaml"
out=$(bash scripts/render-manifests.sh --check --manifests "$work/drift" 2>&1)
rc=$?
if ((rc == 1)) && grep -q -- '^-            - --listen=:1108$' <<<"$out" && grep -q -- '^+            - --listen=:1107$' <<<"$out"; then
	ok "a planted drift (kilo-k3s.yaml's --listen edited) is caught (exit 1) and shown: $(grep -c '^[-+] ' <<<"$out") changed lines"
else
	bad "the planted drift was not caught (exit $rc): $out"
fi
cp manifests/*.yaml "$work/drift/"
printf '# an extra comment\n' >>"$work/drift/crds.yaml"
if ! bash scripts/render-manifests.sh --check --manifests "$work/drift" >/dev/null 2>&1; then
	ok "a planted drift in crds.yaml (a comment appended) is caught"
else
	bad "a comment appended to crds.yaml was not caught"
fi

echo "== 5. docs/helm.md's values table is scripts/helm-values-doc.sh's output"
if ! table=$(bash scripts/helm-values-doc.sh 2>&1); then
	bad "scripts/helm-values-doc.sh failed: $table"
else
	documented=$(sed -n '/^<!-- values table: scripts\/helm-values-doc.sh -->$/,/^<!-- end of values table -->$/p' docs/helm.md | sed '1d;$d')
	if [[ -z $documented ]]; then
		bad "docs/helm.md has no values table between its markers"
	elif [[ $documented == "$table" ]]; then
		ok "docs/helm.md's values table ($(($(wc -l <<<"$table") - 2)) values) is the script's output"
	else
		bad "docs/helm.md's values table differs from scripts/helm-values-doc.sh: $(diff <(echo "$documented") <(echo "$table") | head -20)"
	fi
fi

echo "== 6. helm uninstall's pre-delete hook"
hook=$("$helm" template kilo "$chart" --namespace kube-system --show-only templates/uninstall-hook.yaml 2>&1)
kinds=$(grep '^kind: ' <<<"$hook" | cut -d' ' -f2 | paste -sd, -)
if [[ $kinds == ServiceAccount,Role,RoleBinding,Job ]] && grep -q -- '- --daemonset=kilo$' <<<"$hook" &&
	grep -q -- '- /usr/local/bin/kgctl$' <<<"$hook" && [[ $(grep -c 'helm.sh/hook: pre-delete' <<<"$hook") == 4 ]]; then
	ok "the hook: $kinds, pre-delete, kgctl uninstall --daemonset=kilo"
else
	bad "the hook renders: $hook"
fi
if out=$("$helm" template kilo "$chart" --namespace kube-system --set uninstallHook.enabled=false \
	--show-only templates/uninstall-hook.yaml 2>&1); then
	bad "uninstallHook.enabled=false still renders the hook: $out"
else
	ok "uninstallHook.enabled=false renders no hook"
fi

echo "lint.sh: $passed passed, $failed failed, in $((SECONDS - start)) s"
((failed == 0)) || exit 1
