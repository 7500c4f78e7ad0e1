#!/usr/bin/env bash
# Build, once, a real Kubernetes v1.20.2 control plane for tests and cache it outside the repository;
# with --with-node-bins, also the node side (the cache of scripts/kube-node-bins.sh) in the same
# build.
#
#   scripts/kube-apiserver.sh                    # prints (last line of stdout) the cache directory
#   scripts/kube-apiserver.sh --with-node-bins   # the same, after filling both caches
#
# The cache directory, ${KILOTUN_CACHE:-/var/cache/kilotun}/k8s-v1.20.2, holds
#   bin/kube-apiserver  built from Debian bookworm's source package `kubernetes` (upstream v1.20.2
#                       with vendor/), with Go 1.15 from Debian bullseye
#   bin/etcd            from bookworm's etcd-server (3.4.x), unpacked, not installed
#   bin/kubectl         from bookworm's kubernetes-client (v1.20.2), unpacked, not installed
#   VERSIONS            what each binary reports and which Debian packages it came from
# If the three binaries are already there the script only prints the path.
#
# --with-node-bins also fills ${KILOTUN_CACHE:-/var/cache/kilotun}/k8s-v1.20.2-node, the cache
# scripts/kube-node-bins.sh documents (and prints; it runs this script with --with-node-bins):
#   bin/kubelet                  built like kube-apiserver, from the same source tree in the same
#   bin/kube-scheduler           Go build, CGO_ENABLED=0 (static)
#   bin/kube-controller-manager
#   bin/pause                    build/pause/linux/pause.c of the same tree, gcc -static
#   images/pause.oci.tar         an OCI archive of that pause binary alone, named PAUSE_IMAGE
#                                (io.containerd.image.name), for `ctr images import`
#   PAUSE_IMAGE                  the image name (k8s.gcr.io/pause:<TAG of build/pause/Makefile>)
#   VERSIONS                     what each binary reports and where it came from
# Whatever is missing of the two caches is built from one unpacked source tree, one
# `make gen_openapi` and one `go install` of all the Go binaries (they share most of their
# packages); complete caches are left alone, and when both are complete the script only prints
# the path.
#
# Everything comes from the Debian archive, so it works on a machine that reaches only Debian's
# mirror. apt runs with a private configuration (its own sources list, index and download
# directories under a temporary directory), so the machine's apt setup is neither read for
# sources nor changed. Only `rsync`, `make` and `dpkg-dev` (and, for the node side, `gcc` and
# `libc6-dev`), when missing, are installed system-wide (the Kubernetes build scripts,
# dpkg-source and the static pause need them).
#
# Environment:
#   KILOTUN_CACHE            cache root (default /var/cache/kilotun); must be outside the repository
#   KILOTUN_DEBIAN_MIRROR    Debian mirror for bookworm (default: the one this machine's apt uses;
#                            with neither, the script stops and says so)
#   KILOTUN_BULLSEYE_MIRROR  Debian mirror for bullseye's Go 1.15 (default: the bookworm mirror)
#
# The first run takes a few minutes, several with --with-node-bins (the Go build is CPU-bound;
# run it under `nice` on a shared machine). Concurrent callers serialise on a lock per cache
# (the control plane's first, then the node side's); the loser finds the cache filled.
set -euo pipefail

readonly K8S_VERSION=v1.20.2
# Go 1.18 and later miscompile the reflect2 copy vendored by this tree, so the toolchain is pinned
# to the Go 1.15 that Kubernetes 1.20 was released with (Debian bullseye's golang-1.15).
readonly GO_PKG_VERSION=1.15
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
readonly BINS=(kube-apiserver etcd kubectl)
readonly NODE_BINS=(kubelet kube-scheduler kube-controller-manager pause)

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
cache_dir="$cache_root/k8s-$K8S_VERSION"
node_cache_dir="$cache_root/k8s-$K8S_VERSION-node"

log() { printf 'kube-apiserver.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

with_node=false
for arg; do
	case $arg in
	--with-node-bins) with_node=true ;;
	*) die "unknown argument '$arg' (usage: $0 [--with-node-bins])" ;;
	esac
done

# True when every binary is in the cache and executable.
cache_complete() {
	local b
	for b in "${BINS[@]}"; do
		[[ -x "$cache_dir/bin/$b" ]] || return 1
	done
}
# The same for the node side's cache (scripts/kube-node-bins.sh checks it the same way).
node_cache_complete() {
	local b
	for b in "${NODE_BINS[@]}"; do
		[[ -x "$node_cache_dir/bin/$b" ]] || return 1
	done
	[[ -s $node_cache_dir/images/pause.oci.tar && -s $node_cache_dir/PAUSE_IMAGE ]]
}
# What is left to build: sets build_api and build_node (true/false).
plan() {
	build_api=true build_node=false
	! cache_complete || build_api=false
	! $with_node || node_cache_complete || build_node=true
}

# Fast path: nothing to do, no lock, no network.
plan
if ! $build_api && ! $build_node; then
	printf '%s\n' "$cache_dir"
	exit 0
fi

# shellcheck source=scripts/cache-build.sh
source "$script_dir/cache-build.sh"
cache_lock "k8s-$K8S_VERSION"
if $with_node; then
	# The node side's lock (the one scripts/kube-node-bins.sh took when it built on its own), on
	# a second descriptor, always after the control plane's: no two builders wait on each other.
	exec 8>"$cache_root/.k8s-$K8S_VERSION-node.lock"
	if ! flock -n 8; then
		log "another build holds $cache_root/.k8s-$K8S_VERSION-node.lock; waiting for it"
		flock 8
	fi
fi
plan
if ! $build_api && ! $build_node; then
	printf '%s\n' "$cache_dir"
	exit 0
fi
cache_workdir "k8s-$K8S_VERSION"
what=()
! $build_api || what+=("kube-apiserver, etcd, kubectl ($cache_dir)")
! $build_node || what+=("kubelet, kube-scheduler, kube-controller-manager, pause ($node_cache_dir)")
log "building ${what[0]}${what[1]:+; ${what[1]}}"

########################################################################################################
phase tools
# The Kubernetes build uses rsync (placing binaries) and make; dpkg-source comes with dpkg-dev;
# the static pause needs gcc and the static C library.
missing=()
command -v rsync >/dev/null || missing+=(rsync)
command -v make >/dev/null || missing+=(make)
command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
if $build_node; then
	command -v gcc >/dev/null || missing+=(gcc)
	[[ -e /usr/lib/x86_64-linux-gnu/libc.a || -e /usr/lib/libc.a ]] || missing+=(libc6-dev)
fi
for tool in apt-get dpkg flock realpath sha256sum tar; do
	command -v "$tool" >/dev/null || die "$tool not found; this script needs a Debian-based system"
done
[[ -r $KEYRING ]] || die "$KEYRING missing (package debian-archive-keyring); cannot verify the Debian archive"
if ((${#missing[@]})); then
	[[ $(id -u) -eq 0 ]] || die "missing ${missing[*]}; install them (apt-get install ${missing[*]}) or run as root"
	log "installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	# The machine's package lists may be absent (slim images) or stale; update once and retry.
	if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
		apt-get update -q >&2 || die "apt-get update failed"
		apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 || die "cannot install ${missing[*]}"
	fi
fi

########################################################################################################
phase apt-index
# The Debian mirror this machine uses (scripts/debian-mirror.sh).
# shellcheck source=scripts/debian-mirror.sh
source "$script_dir/debian-mirror.sh"
mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")
mirror=${mirror%/}
bullseye_mirror=${KILOTUN_BULLSEYE_MIRROR:-$mirror}
bullseye_mirror=${bullseye_mirror%/}
log "Debian mirror: $mirror (bullseye: $bullseye_mirror)"

# bookworm's binary index only for etcd and kubectl, which only the control plane's cache holds.
sources=("deb-src [signed-by=$KEYRING] $mirror bookworm main")
! $build_api || sources+=("deb [signed-by=$KEYRING] $mirror bookworm main")
sources+=("deb [signed-by=$KEYRING] $bullseye_mirror bullseye main")
private_apt "$work/apt" "${sources[@]}"
# --error-on=any: a mirror that cannot be reached must fail here, not as "no deb-src" later.
apt-get "${apt_opts[@]}" --error-on=any update >&2 ||
	die "apt-get update failed for $mirror (bookworm) / $bullseye_mirror (bullseye); set KILOTUN_DEBIAN_MIRROR or KILOTUN_BULLSEYE_MIRROR"

########################################################################################################
phase download
dl="$work/dl"
mkdir -p "$dl"
(cd "$dl" && apt-get "${apt_opts[@]}" source --download-only kubernetes/bookworm >&2) ||
	die "cannot download the source package kubernetes/bookworm from $mirror"
(cd "$dl" && apt-get "${apt_opts[@]}" download \
	"golang-$GO_PKG_VERSION-go/bullseye" "golang-$GO_PKG_VERSION-src/bullseye" >&2) ||
	die "cannot download golang-$GO_PKG_VERSION-go and -src (bullseye) from $bullseye_mirror"
if $build_api; then
	(cd "$dl" && apt-get "${apt_opts[@]}" download etcd-server/bookworm kubernetes-client/bookworm >&2) ||
		die "cannot download etcd-server or kubernetes-client (bookworm) from $mirror"
fi

########################################################################################################
phase unpack
shopt -s nullglob
dscs=("$dl"/kubernetes_*.dsc)
((${#dscs[@]} == 1)) || die "expected one kubernetes_*.dsc in $dl, found ${#dscs[@]}"
src="$work/src"
# --no-check: the .dsc signature cannot be checked without the uploader keyrings; the files were
# fetched through apt, which verified them against the signed Sources index.
dpkg-source -x --no-check "${dscs[0]}" "$src" >&2 || die "dpkg-source could not unpack ${dscs[0]}"
# Debian's source keeps the upstream tree, including the version stamp git-archive left in
# hack/lib/version.sh; make sure it is the release we expect.
grep -q "tag: $K8S_VERSION'" "$src/hack/lib/version.sh" ||
	die "the kubernetes source package is not upstream $K8S_VERSION (hack/lib/version.sh)"

# The binary packages are only unpacked (dpkg -x), never installed: installing etcd-server would
# start a system service, and nothing here should change the machine.
root="$work/root"
mkdir -p "$root"
for deb in "$dl"/*.deb; do
	dpkg -x "$deb" "$root" || die "dpkg -x $deb failed"
done
goroot="$root/usr/lib/go-$GO_PKG_VERSION"
[[ -x $goroot/bin/go ]] || die "golang-$GO_PKG_VERSION-go did not contain $goroot/bin/go"
if $build_api; then
	[[ -x $root/usr/bin/etcd ]] || die "etcd-server did not contain /usr/bin/etcd"
	[[ -x $root/usr/bin/kubectl ]] || die "kubernetes-client did not contain /usr/bin/kubectl"
fi

########################################################################################################
phase build
# Offline, pure-Go build with the unpacked Go 1.15 (GOROOT must be explicit because the toolchain
# is not at its packaged path). GOPROXY=off and the tree's vendor/ keep it off the network;
# GOFLAGS is cleared so the caller's settings (-mod=mod, for example) cannot leak in.
# hack/lib sets GOPATH and GOCACHE under _output/ in the source tree, so the Go build cache goes
# away with it. The Kubernetes build already links with -s -w and compiles with -trimpath.
#
# CGO_ENABLED=0 for every binary, the kubelet too (the Kubernetes build would otherwise link it
# with cgo: the test nodes need nothing cgo brings). KUBE_STATIC_OVERRIDES=kubelet puts it in the
# build's "static" group with the others: that group compiles with `-installsuffix static`, a
# compiler flag and so part of Go's cache keys, and a kubelet built apart would compile every
# package it shares with them a second time. One `go install` builds them all, each package once.
# GOGC=400 makes the compiler and linker collect garbage less often: about a sixth less CPU
# for this tree (more memory, about 1 GB per compile at most), and the same output.
build_env=(
	env -u GOBIN -u GOPATH -u GOCACHE -u GOMODCACHE -u GO111MODULE -u KUBE_CGO_OVERRIDES
	"GOROOT=$goroot"
	"PATH=$goroot/bin:$PATH"
	"HOME=$work/home"
	GOPROXY=off
	GOFLAGS=
	GOSUMDB=off
	CGO_ENABLED=0
	KUBE_STATIC_OVERRIDES=kubelet
	GOGC=400
)
mkdir -p "$work/home"
"${build_env[@]}" go version >&2 || die "the unpacked Go toolchain does not run"
go_bins=()
! $build_api || go_bins+=(kube-apiserver)
! $build_node || go_bins+=(kubelet kube-scheduler kube-controller-manager)
# kube-apiserver, the controller-manager and the scheduler import pkg/generated/openapi, which the
# release tree does not contain; generate it first, then build only the binaries wanted.
(cd "$src" && "${build_env[@]}" make gen_openapi >&2) || die "make gen_openapi failed"
(cd "$src" && "${build_env[@]}" hack/make-rules/build.sh "${go_bins[@]/#/cmd/}" >&2) ||
	die "building ${go_bins[*]/#/cmd/} failed"
for b in "${go_bins[@]}"; do
	[[ -x $src/_output/bin/$b ]] || die "the build did not produce $src/_output/bin/$b"
done

if $build_node; then
	####################################################################################################
	phase pause
	# The pause container of the same tree, built as its Makefile does (static, -Os), with its TAG.
	pause_c=$src/build/pause/linux/pause.c
	[[ -r $pause_c ]] || pause_c=$src/build/pause/pause.c
	[[ -r $pause_c ]] || die "no build/pause/linux/pause.c in the kubernetes source"
	pause_tag=$(sed -n '/^TAG[[:space:]]*?*=/{s/^TAG[[:space:]]*?*=[[:space:]]*\([0-9.]*\).*/\1/p;q;}' "$src/build/pause/Makefile")
	[[ -n $pause_tag ]] || die "no TAG in build/pause/Makefile"
	gcc -Os -Wall -Werror -static -DVERSION="v$pause_tag" -o "$work/pause" "$pause_c" >&2 ||
		die "gcc -static failed on $pause_c (is libc6-dev installed?)"
	strip "$work/pause" 2>/dev/null || true
	pause_image="k8s.gcr.io/pause:$pause_tag"

	# An OCI image archive holding only /pause, assembled by hand (no image tool needed): a layer
	# tar with fixed owners and times, a config naming /pause as the entrypoint, a manifest and an
	# index whose io.containerd.image.name annotation names the image on `ctr images import`.
	oci="$work/oci"
	mkdir -p "$oci/blobs/sha256" "$work/layer"
	cp "$work/pause" "$work/layer/pause"
	chmod 0755 "$work/layer/pause"
	tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
		--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
		-cf "$work/layer.tar" -C "$work/layer" pause
	blob() { # FILE -> moves it into blobs/, prints "sha256:<hex> <size>"
		local hex size
		hex=$(sha256sum "$1" | cut -d' ' -f1)
		size=$(stat -c %s "$1")
		mv "$1" "$oci/blobs/sha256/$hex"
		printf 'sha256:%s %s\n' "$hex" "$size"
	}
	read -r layer_digest layer_size < <(blob "$work/layer.tar")
	printf '{"architecture":"amd64","os":"linux","config":{"Entrypoint":["/pause"],"User":"65535:65535"},"rootfs":{"type":"layers","diff_ids":["%s"]}}' \
		"$layer_digest" >"$work/config.json"
	read -r config_digest config_size < <(blob "$work/config.json")
	printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar","digest":"%s","size":%s}]}' \
		"$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$work/manifest.json"
	read -r manifest_digest manifest_size < <(blob "$work/manifest.json")
	printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}]}' \
		"$manifest_digest" "$manifest_size" "$pause_image" "$pause_tag" >"$oci/index.json"
	printf '{"imageLayoutVersion":"1.0.0"}' >"$oci/oci-layout"
fi

########################################################################################################
phase install
# Each cache is staged whole, checked, then published atomically: a half-filled cache directory
# (someone removed a binary) is replaced whole.
go_version=$("${build_env[@]}" go version)
publish() { # STAGE CACHE_DIR
	if [[ -e $2 ]]; then
		mv "$2" "$work/old-cache-$(basename "$2")"
	fi
	mv -T "$1" "$2"
}
if $build_api; then
	stage="$work/out"
	mkdir -p "$stage/bin"
	cp "$src/_output/bin/kube-apiserver" "$stage/bin/kube-apiserver"
	cp "$root/usr/bin/etcd" "$stage/bin/etcd"
	cp "$root/usr/bin/kubectl" "$stage/bin/kubectl"
	chmod 0755 "$stage/bin/"*

	# Check that each binary runs and is the version we want.
	apiserver_version=$("$stage/bin/kube-apiserver" --version) || die "the built kube-apiserver does not run"
	[[ $apiserver_version == "Kubernetes $K8S_VERSION" ]] ||
		die "kube-apiserver reports '$apiserver_version', expected 'Kubernetes $K8S_VERSION'"
	kubectl_version=$("$stage/bin/kubectl" version --client --short) || die "kubectl does not run"
	[[ $kubectl_version == *"$K8S_VERSION"* ]] || die "kubectl reports '$kubectl_version', expected $K8S_VERSION"
	# Its first line only, cut here: `| head -n1` can close the pipe before etcd has written the
	# rest, and the SIGPIPE it then dies of fails the check (about one run in four on a busy
	# machine).
	etcd_version=$("$stage/bin/etcd" --version) || die "etcd does not run"
	etcd_version=${etcd_version%%$'\n'*}
	{
		echo "kube-apiserver: $apiserver_version (source: $(basename "${dscs[0]}" .dsc), $go_version)"
		echo "kubectl: $kubectl_version ($(cd "$dl" && echo kubernetes-client_*.deb))"
		echo "etcd: $etcd_version ($(cd "$dl" && echo etcd-server_*.deb))"
	} >"$stage/VERSIONS"
	cat "$stage/VERSIONS" >&2
fi
if $build_node; then
	node_stage="$work/node-out"
	mkdir -p "$node_stage/bin" "$node_stage/images"
	for b in kubelet kube-scheduler kube-controller-manager; do
		cp "$src/_output/bin/$b" "$node_stage/bin/$b"
	done
	cp "$work/pause" "$node_stage/bin/pause"
	chmod 0755 "$node_stage/bin/"*
	tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
		-cf "$node_stage/images/pause.oci.tar" -C "$oci" .
	printf '%s\n' "$pause_image" >"$node_stage/PAUSE_IMAGE"

	{
		for b in kubelet kube-scheduler kube-controller-manager; do
			v=$("$node_stage/bin/$b" --version 2>&1) || die "the built $b does not run"
			[[ $v == "Kubernetes $K8S_VERSION" ]] || die "$b reports '$v', expected 'Kubernetes $K8S_VERSION'"
			echo "$b: $v (source: $(basename "${dscs[0]}" .dsc), $go_version)"
		done
		v=$("$node_stage/bin/pause" -v 2>&1) || die "the built pause does not run"
		echo "pause: $v ($pause_image, $manifest_digest; ${pause_c#"$src"/}, $(gcc --version | head -n1))"
	} >"$node_stage/VERSIONS"
	cat "$node_stage/VERSIONS" >&2
fi
# Published only once everything built and checked.
! $build_api || publish "$stage" "$cache_dir"
! $build_node || publish "$node_stage" "$node_cache_dir"

########################################################################################################
phase cleanup
# The source tree, Go toolchain, downloads and Go build cache are all under $work.
cache_workdir_remove
trap - EXIT
phase ''
log "total: $((SECONDS - total_start))s; cache $(du -sh "$cache_dir" | cut -f1) in $cache_dir"
! $build_node || log "node cache $(du -sh "$node_cache_dir" | cut -f1) in $node_cache_dir"
printf '%s\n' "$cache_dir"
