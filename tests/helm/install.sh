#!/usr/bin/env bash
# The chart against a real kube-apiserver v1.20.2 (scripts/kube-up.sh: etcd and the API server
# only, no controllers or kubelets), with helm v4.1.4 and kubectl v1.35.2 as the clients
# (scripts/helm-tools.sh):
#   1. kubectl 1.35 `apply --dry-run=server` of every shipped manifest against the 1.20 server
#      (what works across that skew, what does not and why);
#   2. helm install (with crds/), upgrade changing a flag (a new pod template: generation + 1,
#      the flag in kg's args), rollback (the flag gone, generation + 1 again), uninstall (no
#      object of the release left; the CRD kept, as Helm keeps crds/; --no-hooks, since no
#      kubelet runs the pre-delete hook's Job here: tests/real/real_kubelet/chart.rs runs it);
#   3. from the plain manifests to the chart without a rollout: helm refuses to take over
#      objects it does not own, takes them over once labelled and annotated (docs/helm.md), and
#      the DaemonSet keeps its uid and generation (no pod is replaced);
#   4. surge: `updateStrategy.surge=auto` renders one-node-at-a-time on 1.20; `true` is refused
#      there, as docs/rollouts.md says.
#
#   sudo bash tests/helm/install.sh   # exit 0: passed; 1: failed; 77: skipped (not root, no
#                                     # cached API server, no helm)
set -uo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
chart="$repo/charts/kilotun"
cd "$repo"
start=$SECONDS
name=install.sh
. "$repo/tests/helm/api-server.sh"
work_dir install
start_api_server
server=$("$kubectl" version -o json 2>/dev/null | sed -n 's/.*"gitVersion": "\(v1\.20[^"]*\)".*/\1/p' | tail -1)
echo "install.sh: $("$helm" version --short), kubectl $("$kubectl" version --client -o json | sed -n 's/.*"gitVersion": "\([^"]*\)".*/\1/p' | head -1), server ${server:-?}"
[[ $server == v1.20.2 ]] || bad "the server says ${server:-nothing}, not v1.20.2"

# Prometheus Operator's PodMonitor as a bare CRD (any spec), so that podmonitor.yaml and the
# chart's PodMonitor have a kind to be.
k apply -f - >/dev/null <<'EOF'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: podmonitors.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  names: {kind: PodMonitor, listKind: PodMonitorList, plural: podmonitors, singular: podmonitor}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
EOF
k wait --for=condition=Established crd/podmonitors.monitoring.coreos.com --timeout=30s >/dev/null

echo "== 1. kubectl v1.35.2 apply --dry-run=server of each shipped manifest against v1.20.2"
# A dry run does not create the namespace it would create, so peer-validation.yaml's objects
# in namespace kilo need it there first.
k create namespace kilo >/dev/null
for f in manifests/*.yaml; do
	out=$(k apply --dry-run=server -f "$f")
	rc=${PIPESTATUS[0]}
	case $(basename "$f") in
	kilo-kubeadm.yaml | kilo-k3s.yaml)
		# 1.20's DaemonSet has no maxSurge: kubectl (validating against the server's OpenAPI, as
		# 1.20 has no server-side field validation) refuses it, as docs/rollouts.md says.
		if [[ $out == *'unknown field "maxSurge" in io.k8s.api.apps.v1.RollingUpdateDaemonSet'* ]]; then
			ok "$f: refused on 1.20 as documented: $(grep -o 'unknown field "maxSurge"[^;]*' <<<"$out" | head -1)"
		else
			bad "$f: expected the maxSurge refusal, got: $out"
		fi
		old=$(sed -e '/maxSurge: 1/d' -e 's/maxUnavailable: 0/maxUnavailable: 1/' "$f" | k apply --dry-run=server -f -)
		if [[ $old == *"daemonset.apps/kilo created (server dry run)"* ]]; then
			ok "$f through docs/rollouts.md's sed line: $(tr '\n' ';' <<<"$old")"
		else
			bad "$f through the sed line: $old"
		fi
		;;
	*)
		if [[ $out == *"(server dry run)"* ]] && ! grep -qi '^error' <<<"$out"; then
			ok "$f: $(grep -c 'server dry run' <<<"$out") objects pass the 1.20 server's dry run"
		else
			bad "$f: $out"
		fi
		;;
	esac
done

# The chart's objects of the release, as kinds kubectl knows, in kube-system and cluster-wide.
leftovers() {
	{
		k -n kube-system get daemonsets,deployments,services,configmaps,secrets,serviceaccounts,roles,rolebindings,podmonitors -o name
		k get clusterroles,clusterrolebindings,validatingwebhookconfigurations -o name
	} | grep -E '/(kilo|kilo-|peer-validation|kube-webhook-certgen)' | grep -v 'sh.helm.release' || true
}
ds_field() { k -n kube-system get daemonset kilo -o "jsonpath=$1"; }

echo "== 2. helm install, upgrade, rollback, uninstall"
values=(--set webhook.enabled=true --set webhook.certificate.source=helm
	--set devicePlugin.enabled=true --set requestTun=true
	--set podMonitor.enabled=true --set dashboard.enabled=true)
if out=$("$helm" install kilo "$chart" --namespace kube-system "${values[@]}" 2>&1); then
	ok "helm install: $(grep -E '^(STATUS|REVISION):' <<<"$out" | tr '\n' ' ')"
else
	bad "helm install: $out"
fi
if k get crd peers.kilo.squat.ai -o name | grep -q peers; then
	ok "the Peer CRD came with the release (crds/)"
else
	bad "no Peer CRD after helm install"
fi
objects=$(leftovers)
expected=(daemonset.apps/kilo daemonset.apps/kilo-tun-device-plugin deployment.apps/peer-validation
	service/peer-validation configmap/kilo configmap/kilo-dashboard secret/peer-validation-webhook-tls
	serviceaccount/kilo role.rbac.authorization.k8s.io/kilo-leases rolebinding.rbac.authorization.k8s.io/kilo-leases
	podmonitor.monitoring.coreos.com/kilo clusterrole.rbac.authorization.k8s.io/kilo
	clusterrolebinding.rbac.authorization.k8s.io/kilo
	validatingwebhookconfiguration.admissionregistration.k8s.io/peer-validation)
missing=
for o in "${expected[@]}"; do
	grep -qxF "$o" <<<"$objects" || missing+=" $o"
done
if [[ -z $missing ]]; then
	ok "the release's ${#expected[@]} objects are there"
else
	bad "missing after install:$missing (found: $(tr '\n' ' ' <<<"$objects"))"
fi
strategy=$(ds_field '{.spec.updateStrategy}')
if [[ $strategy == '{"rollingUpdate":{"maxUnavailable":1},"type":"RollingUpdate"}' ]]; then
	ok "updateStrategy.surge=auto on 1.20: one node at a time ($strategy)"
else
	bad "updateStrategy on 1.20: $strategy"
fi
limits=$(ds_field '{.spec.template.spec.containers[0].resources.limits}')
[[ $limits == *'"squat.ai/tun":"1"'* ]] && ok "kg asks for squat.ai/tun ($limits)" || bad "kg's limits: $limits"
ca=$(k get validatingwebhookconfiguration peer-validation -o 'jsonpath={.webhooks[0].clientConfig.caBundle}')
secret_ca=$(k -n kube-system get secret peer-validation-webhook-tls -o 'jsonpath={.data.ca}')
if [[ -n $ca && $(base64 -d <<<"$ca") == $(base64 -d <<<"$secret_ca") ]]; then
	ok "the webhook's caBundle is the CA of the Secret the chart made"
else
	bad "the webhook's caBundle does not match the Secret's CA"
fi
gen1=$(ds_field '{.metadata.generation}')
args1=$(ds_field '{.spec.template.spec.containers[0].args}')

if out=$("$helm" upgrade kilo "$chart" --namespace kube-system --reuse-values --set postQuantum=true 2>&1); then
	ok "helm upgrade --set postQuantum=true: $(grep -E '^(STATUS|REVISION):' <<<"$out" | tr '\n' ' ')"
else
	bad "helm upgrade: $out"
fi
gen2=$(ds_field '{.metadata.generation}')
args2=$(ds_field '{.spec.template.spec.containers[0].args}')
if ((gen2 == gen1 + 1)) && [[ $args2 == *'"--post-quantum=true"'* && $args1 != *post-quantum* ]]; then
	ok "the DaemonSet's pod template changed: generation $gen1 -> $gen2, --post-quantum=true in kg's args"
else
	bad "after the upgrade: generation $gen1 -> $gen2, args $args2"
fi
secret_ca2=$(k -n kube-system get secret peer-validation-webhook-tls -o 'jsonpath={.data.ca}')
[[ $secret_ca2 == "$secret_ca" ]] && ok "the chart-made webhook CA survived the upgrade" || bad "the upgrade replaced the webhook's CA"

if out=$("$helm" rollback kilo 1 --namespace kube-system 2>&1); then
	ok "helm rollback kilo 1: $out"
else
	bad "helm rollback: $out"
fi
gen3=$(ds_field '{.metadata.generation}')
args3=$(ds_field '{.spec.template.spec.containers[0].args}')
if ((gen3 == gen2 + 1)) && [[ $args3 == "$args1" ]]; then
	ok "rolled back: generation $gen2 -> $gen3, --post-quantum gone, kg's args as installed"
else
	bad "after the rollback: generation $gen2 -> $gen3, args $args3"
fi
history=$("$helm" history kilo --namespace kube-system 2>&1 | awk 'NR > 1 {print $1 ":" $(NF - 3)}' | tr '\n' ' ')
ok "helm history: $history"

# No kubelet runs the pre-delete hook's Job here (kgctl uninstall, which waits for the kg pods):
# its run is tests/real/real_kubelet/chart.rs's.
if out=$("$helm" uninstall kilo --namespace kube-system --no-hooks 2>&1); then
	ok "helm uninstall --no-hooks: $out"
else
	bad "helm uninstall: $out"
fi
left=$(leftovers)
if [[ -z $left ]]; then
	ok "nothing of the release left (DaemonSets, Deployment, Service, ConfigMaps, Secret, RBAC, PodMonitor, webhook configuration)"
else
	bad "left after uninstall: $(tr '\n' ' ' <<<"$left")"
fi
if k get crd peers.kilo.squat.ai -o name | grep -q peers; then
	ok "the Peer CRD stays after uninstall (Helm never deletes crds/; kubectl delete crd peers.kilo.squat.ai removes it and every Peer)"
else
	bad "the Peer CRD went with the release"
fi
releases=$("$helm" list --namespace kube-system -q 2>&1)
[[ -z $releases ]] && ok "helm list: no release left" || bad "helm list: $releases"

echo "== 3. from the plain manifests to the chart, without a rollout"
k apply -f manifests/crds.yaml -f manifests/rbac.yaml >/dev/null
sed -e '/maxSurge: 1/d' -e 's/maxUnavailable: 0/maxUnavailable: 1/' manifests/kilo-kubeadm.yaml | k apply -f - >/dev/null
uid0=$(ds_field '{.metadata.uid}')
gen0=$(ds_field '{.metadata.generation}')
if out=$("$helm" install kilo "$chart" --namespace kube-system 2>&1); then
	bad "helm install over the plain manifests' objects succeeded without adopting them"
elif [[ $out == *"exists and cannot be imported into the current release: invalid ownership metadata"* ]]; then
	ok "helm refuses objects it does not own: $(grep -o '[A-Za-z]* "kilo"[^:]*exists and cannot be imported[^;]*' <<<"$out" | head -1)"
else
	bad "helm install over the plain manifests: $out"
fi
# The adoption docs/helm.md gives.
for o in serviceaccount/kilo configmap/kilo daemonset/kilo role/kilo-leases rolebinding/kilo-leases clusterrole/kilo clusterrolebinding/kilo; do
	k -n kube-system label "$o" app.kubernetes.io/managed-by=Helm --overwrite >/dev/null
	k -n kube-system annotate "$o" meta.helm.sh/release-name=kilo meta.helm.sh/release-namespace=kube-system --overwrite >/dev/null
done
if out=$("$helm" install kilo "$chart" --namespace kube-system 2>&1); then
	ok "helm install after labelling and annotating the 7 objects: $(grep -E '^STATUS:' <<<"$out")"
else
	bad "helm install after adoption: $out"
fi
uid1=$(ds_field '{.metadata.uid}')
gen1=$(ds_field '{.metadata.generation}')
if [[ $uid1 == "$uid0" ]] && ((gen1 == gen0)); then
	ok "the DaemonSet is the same object (uid $uid0), generation still $gen0: no pod replaced, the mesh untouched"
else
	bad "the DaemonSet changed: uid $uid0 -> $uid1, generation $gen0 -> $gen1"
fi
# helm 4 applies server-side: the fields kubectl apply set belong to kubectl, so the first
# upgrade after the takeover forces them over (docs/helm.md).
upgraded=$("$helm" upgrade kilo "$chart" --namespace kube-system --force-conflicts --set meshGranularity=full 2>&1)
gen2=$(ds_field '{.metadata.generation}')
args=$(ds_field '{.spec.template.spec.containers[0].args}')
if ((gen2 == gen1 + 1)) && [[ $args == *'"--mesh-granularity=full"'* ]]; then
	ok "then helm upgrades it like its own: generation $gen1 -> $gen2, --mesh-granularity=full"
else
	bad "helm upgrade of the adopted DaemonSet: generation $gen1 -> $gen2, args $args; helm: $upgraded"
fi
"$helm" uninstall kilo --namespace kube-system --no-hooks >/dev/null 2>&1
left=$(leftovers)
[[ -z $left ]] && ok "uninstalled: nothing left" || bad "left after uninstalling the adopted release: $(tr '\n' ' ' <<<"$left")"

echo "== 4. surge on 1.20"
if out=$("$helm" install kilo "$chart" --namespace kube-system --set updateStrategy.surge=true 2>&1); then
	bad "helm install with updateStrategy.surge=true succeeded on 1.20"
	"$helm" uninstall kilo --namespace kube-system --no-hooks >/dev/null 2>&1
elif [[ $out == *'unknown field "maxSurge"'* ]]; then
	ok "updateStrategy.surge=true on 1.20 is refused: $(grep -o 'unknown field "maxSurge" in [A-Za-z0-9.]*' <<<"$out" | head -1)"
else
	bad "updateStrategy.surge=true on 1.20: $out"
fi

echo "install.sh: $passed passed, $failed failed, in $((SECONDS - start)) s"
((failed == 0)) || exit 1
