#!/usr/bin/env bash
# Build, once, the node side of a real Kubernetes v1.20.2 cluster for tests and cache it outside
# the repository: what scripts/kube-apiserver.sh leaves out by default (it builds the control
# plane's kube-apiserver, etcd and kubectl).
#
#   scripts/kube-node-bins.sh        # prints (last line of stdout) the cache directory
#
# The cache directory, ${KILOTUN_CACHE:-/var/cache/kilotun}/k8s-v1.20.2-node, holds
#   bin/kubelet                  built from Debian bookworm's source package `kubernetes`
#   bin/kube-scheduler           (upstream v1.20.2 with vendor/), with Go 1.15 from Debian
#   bin/kube-controller-manager  bullseye, CGO_ENABLED=0 (static)
#   bin/pause                    build/pause/linux/pause.c of the same tree, gcc -static
#   images/pause.oci.tar         an OCI archive of that pause binary alone, named PAUSE_IMAGE
#                                (io.containerd.image.name), for `ctr images import`
#   PAUSE_IMAGE                  the image name (k8s.gcr.io/pause:<TAG of build/pause/Makefile>)
#   VERSIONS                     what each binary reports and where it came from
# If they are already there the script only prints the path.
#
# Otherwise it runs `scripts/kube-apiserver.sh --with-node-bins`, which builds them (see there:
# the private apt setup, the mirrors, the locks, the packages it may install) in the same source
# tree and Go build as the control plane's kube-apiserver: if that cache is missing too, both
# are filled, for a few minutes more than the node side alone (the Go packages they share are
# compiled once), and the cluster (scripts/kubelet-cluster.sh) needs both.
#
# Environment: as scripts/kube-apiserver.sh (KILOTUN_CACHE, KILOTUN_DEBIAN_MIRROR,
# KILOTUN_BULLSEYE_MIRROR).
#
# The first run takes several minutes (three or four Go binaries, CPU-bound; run it under `nice`
# on a shared machine). Concurrent callers serialise on locks; the loser finds the cache filled.
set -euo pipefail

readonly K8S_VERSION=v1.20.2
readonly BINS=(kubelet kube-scheduler kube-controller-manager pause)

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
cache_dir="$cache_root/k8s-$K8S_VERSION-node"

log() { printf 'kube-node-bins.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# True when every file is in the cache (scripts/kube-apiserver.sh checks it the same way).
cache_complete() {
	local b
	for b in "${BINS[@]}"; do
		[[ -x "$cache_dir/bin/$b" ]] || return 1
	done
	[[ -s $cache_dir/images/pause.oci.tar && -s $cache_dir/PAUSE_IMAGE ]]
}

# Fast path: nothing to do, no lock, no network.
if cache_complete; then
	printf '%s\n' "$cache_dir"
	exit 0
fi

log "building with scripts/kube-apiserver.sh --with-node-bins"
bash "$script_dir/kube-apiserver.sh" --with-node-bins >/dev/null ||
	die "scripts/kube-apiserver.sh --with-node-bins failed"
cache_complete || die "scripts/kube-apiserver.sh --with-node-bins did not fill $cache_dir"
printf '%s\n' "$cache_dir"
