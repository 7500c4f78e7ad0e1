#!/usr/bin/env bash
# From Cozystack's Kilo chart to kilotun's, against a real kube-apiserver v1.20.2
# (scripts/kube-up.sh: no controllers or kubelets), with helm v4.1.4 and kubectl v1.35.2
# (scripts/helm-tools.sh), as docs/helm.md ("From Cozystack's chart") tells an operator to do:
#   1. Cozystack's chart (packages/system/kilo of its source) installed as Cozystack installs
#      it: release kilo in namespace cozy-kilo, its CRD among its templates; a Peer made;
#   2. the CRD marked helm.sh/resource-policy=keep, then `helm upgrade` of the same release to
#      charts/kilotun with Cozystack's settings as kilotun's values: the Peer and the CRD stay,
#      the DaemonSet is the same object with kilotun's pod template and the same flags, the old
#      kubeconfig ConfigMap is replaced by the chart's own for the same API server;
#   3. `helm rollback` to Cozystack's revision is refused (the CRD), `helm upgrade` back to
#      Cozystack's chart and forward again work, and `helm uninstall` keeps the CRD and the Peer.
# Cozystack's source is in no package registry: KILOTUN_COZYSTACK_SRC names a checkout or a
# bare clone (default /work/.mirror/cozystack+cozystack/repo); without it the script skips.
#
#   sudo bash tests/helm/cozystack.sh   # exit 0: passed; 1: failed; 77: skipped
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
chart="$repo/charts/kilotun"
cd "$repo"
start=$SECONDS
src=${KILOTUN_COZYSTACK_SRC:-/work/.mirror/cozystack+cozystack/repo}
name=cozystack.sh
. "$repo/tests/helm/api-server.sh"
[[ -e $src ]] || skip "Cozystack's source is not on this machine (KILOTUN_COZYSTACK_SRC=$src)"
work_dir cozystack

# Cozystack's chart, from a checkout or from a bare clone's HEAD.
mkdir -p "$dir/cozystack"
if [[ -d $src/packages/system/kilo ]]; then
	cp -r "$src/packages/system/kilo" "$dir/cozystack/"
elif ! git --git-dir="$src" archive HEAD packages/system/kilo | tar -x -C "$dir/cozystack" --strip-components=2; then
	skip "no packages/system/kilo in $src"
fi
cozy="$dir/cozystack/kilo"
[[ -f $cozy/Chart.yaml ]] || skip "no Cozystack chart at $cozy"
commit=$(git --git-dir="$src" rev-parse --short HEAD 2>/dev/null || git -C "$src" rev-parse --short HEAD 2>/dev/null || echo '?')

# Cozystack's DaemonSet runs privileged, which the API server allows only when told so (as
# every real cluster's is).
start_api_server --allow-privileged=true
ds_field() { k -n cozy-kilo get daemonset kilo -o "jsonpath=$1"; }

echo "== 1. Cozystack's chart (its commit $commit), as Cozystack installs it"
k create namespace cozy-kilo >/dev/null
# Cozystack's platform installs the release with values.yaml and values-cilium.yaml
# (packages/core/platform/sources/networking.yaml, the cilium-kilo variant).
cozy_values=(-f "$cozy/values.yaml")
[[ -f $cozy/values-cilium.yaml ]] && cozy_values+=(-f "$cozy/values-cilium.yaml")
if out=$("$helm" install kilo "$cozy" --namespace cozy-kilo "${cozy_values[@]}" 2>&1); then
	ok "helm install of Cozystack's chart: $(grep -E '^STATUS:' <<<"$out"), image $(ds_field '{.spec.template.spec.containers[0].image}' | cut -d@ -f1)"
else
	bad "helm install of Cozystack's chart: $out"
	echo "cozystack.sh: $passed passed, $failed failed"
	exit 1
fi
k wait --for=condition=Established crd/peers.kilo.squat.ai --timeout=30s >/dev/null
k apply -f - >/dev/null <<'YAML'
apiVersion: kilo.squat.ai/v1alpha1
kind: Peer
metadata:
  name: laptop
spec:
  allowedIPs: [10.5.0.1/32]
  publicKey: GY5aT1N9dTR/nJnT1N2f4ClZWVj0jOAld0r8ysWLyjg=
  persistentKeepalive: 10
YAML
peer_uid=$(k get peer laptop -o 'jsonpath={.metadata.uid}')
[[ -n $peer_uid ]] && ok "a Peer made (uid $peer_uid)" || bad "no Peer made"
uid0=$(ds_field '{.metadata.uid}')
gen0=$(ds_field '{.metadata.generation}')

echo "== 2. helm upgrade of the same release to charts/kilotun"
k annotate crd peers.kilo.squat.ai helm.sh/resource-policy=keep --overwrite >/dev/null
# Cozystack's values (values.yaml and values-cilium.yaml) and fixed flags as kilotun's values
# (docs/helm.md has the table).
takeover=(
	--set apiServer=https://127.0.0.1:7445
	--set transitCIDR=100.66.0.0/16
	--set meshGranularity=location
	--set compatibility=cilium
	--set cleanUpInterface=false
	--set mtu=auto
	--set cni.enabled=false
	--set encapsulate=crosssubnet
	--set local=false
	--set-json 'extraEnv=[{"name":"NODE_IP","valueFrom":{"fieldRef":{"fieldPath":"status.hostIP"}}}]'
	--set 'extraArgs[0]=--internal-cidr=$(NODE_IP)/32'
)
if out=$("$helm" upgrade kilo "$chart" --namespace cozy-kilo "${takeover[@]}" 2>&1); then
	ok "helm upgrade to kilotun's chart: $(grep -E '^STATUS:|^REVISION:' <<<"$out" | tr '\n' ' ')"
else
	bad "helm upgrade to kilotun's chart: $out"
fi
if [[ $(k get peer laptop -o 'jsonpath={.metadata.uid}') == "$peer_uid" ]]; then
	ok "the Peer is still there (the CRD kept by its resource policy)"
else
	bad "the Peer is gone: $(k get crd peers.kilo.squat.ai 2>&1 | tail -1)"
fi
uid1=$(ds_field '{.metadata.uid}')
gen1=$(ds_field '{.metadata.generation}')
image=$(ds_field '{.spec.template.spec.containers[0].image}')
args=$(ds_field '{.spec.template.spec.containers[0].args}')
if [[ $uid1 == "$uid0" ]] && ((gen1 == gen0 + 1)) && [[ $image == kilotun:* ]]; then
	ok "the DaemonSet is the same object (uid $uid0), generation $gen0 -> $gen1 (a rollout), image $image"
else
	bad "the DaemonSet: uid $uid0 -> $uid1, generation $gen0 -> $gen1, image $image"
fi
missing=""
for flag in --kubeconfig=/etc/kubernetes/kubeconfig --subnet=100.66.0.0/16 --mesh-granularity=location \
	--compatibility=cilium --cni=false --encapsulate=crosssubnet --local=false '--internal-cidr=$(NODE_IP)/32'; do
	[[ $args == *"\"$flag\""* ]] || missing+=" $flag"
done
[[ -z $missing ]] && ok "kg's flags carry Cozystack's settings" || bad "kg's args lack:$missing ($args)"
server=$(k -n cozy-kilo get configmap kilo-kubeconfig -o 'jsonpath={.data.kubeconfig}' | awk '$1 == "server:" { gsub(/"/, "", $2); print $2 }')
volume=$(ds_field '{.spec.template.spec.volumes[?(@.name=="kubeconfig")].configMap.name}')
if [[ $server == https://127.0.0.1:7445 && $volume == kilo-kubeconfig ]] &&
	! k -n cozy-kilo get configmap kubeconfig-in-cluster -o name >/dev/null 2>&1; then
	ok "kg's kubeconfig: the chart's kilo-kubeconfig (its volume) for $server; Cozystack's kubeconfig-in-cluster removed"
else
	bad "kubeconfig: server '${server}', volume '${volume}', $(k -n cozy-kilo get configmaps -o name | tr '\n' ' ')"
fi

echo "== 3. back to Cozystack's chart, forward again, uninstall"
# helm rollback cannot go back: revision 1 owned the CRD, which revision 2 left to its resource
# policy, and the rollback looks for it among revision 2's objects (docs/helm.md).
if out=$("$helm" rollback kilo 1 --namespace cozy-kilo 2>&1); then
	bad "helm rollback to Cozystack's revision succeeded, which docs/helm.md says it does not"
elif [[ $out == *'original object CustomResourceDefinition with the name "peers.kilo.squat.ai" not found'* ]]; then
	ok "helm rollback to Cozystack's revision is refused, as docs/helm.md says: $(grep -o 'original object[^"]*"peers.kilo.squat.ai" not found' <<<"$out" | head -1)"
else
	bad "helm rollback: $out"
fi
# An upgrade to Cozystack's chart takes the CRD back (it still carries the release's marks),
# applied client-side: server-side, helm 4 leaves a half-removed probe of kilotun's behind
# (port 0) and conflicts with the API server over the CRD's status.
if out=$("$helm" upgrade kilo "$cozy" --namespace cozy-kilo "${cozy_values[@]}" --server-side=false 2>&1) &&
	[[ $(ds_field '{.spec.template.spec.containers[0].image}') == ghcr.io/cozystack/* ]] &&
	[[ $(k get peer laptop -o 'jsonpath={.metadata.uid}') == "$peer_uid" ]]; then
	ok "helm upgrade back to Cozystack's chart: its image again, the Peer kept"
else
	bad "helm upgrade back to Cozystack's chart: $out; image $(ds_field '{.spec.template.spec.containers[0].image}')"
fi
k annotate crd peers.kilo.squat.ai helm.sh/resource-policy=keep --overwrite >/dev/null
if out=$("$helm" upgrade kilo "$chart" --namespace cozy-kilo "${takeover[@]}" 2>&1) &&
	[[ $(ds_field '{.spec.template.spec.containers[0].image}') == kilotun:* ]] &&
	[[ $(k get peer laptop -o 'jsonpath={.metadata.uid}') == "$peer_uid" ]]; then
	ok "and forward to kilotun's chart again (the CRD marked again first), the Peer kept"
else
	bad "helm upgrade to kilotun's chart a second time: $out"
fi
"$helm" uninstall kilo --namespace cozy-kilo --no-hooks >/dev/null 2>&1
if [[ $(k get peer laptop -o 'jsonpath={.metadata.uid}') == "$peer_uid" ]] &&
	! k -n cozy-kilo get daemonset kilo -o name >/dev/null 2>&1; then
	ok "helm uninstall (--no-hooks: no kubelet runs the hook here) removed the DaemonSet and kept the CRD and the Peer"
else
	bad "after helm uninstall: $(k get peers,daemonsets -A -o name 2>&1 | tr '\n' ' ')"
fi

echo "cozystack.sh: $passed passed, $failed failed, in $((SECONDS - start)) s"
((failed == 0)) || exit 1
