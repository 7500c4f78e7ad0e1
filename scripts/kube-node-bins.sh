#!/usr/bin/env bash
# Build, once, the node side of a real Kubernetes v1.20.2 cluster for tests and cache it outside
# the repository: what scripts/kube-apiserver.sh leaves out (it builds the control plane's
# kube-apiserver, etcd and kubectl).
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
# Everything comes from the Debian archive, so it works on a machine that reaches only Debian's
# mirror. apt runs with a private configuration (its own sources list, index and download
# directories under a temporary directory), so the machine's apt setup is neither read for
# sources nor changed. Only `rsync`, `make`, `dpkg-dev`, `gcc` and `libc6-dev`, when missing, are
# installed system-wide (the Kubernetes build scripts, dpkg-source and the static pause need them).
#
# Environment:
#   KILOTUN_CACHE            cache root (default /var/cache/kilotun); must be outside the repository
#   KILOTUN_DEBIAN_MIRROR    Debian mirror for bookworm (default: the one this machine's apt uses;
#                            with neither, the script stops and says so)
#   KILOTUN_BULLSEYE_MIRROR  Debian mirror for bullseye's Go 1.15 (default: the bookworm mirror)
#
# The first run takes several minutes (three Go binaries, CPU-bound; run it under `nice` on a
# shared machine). Concurrent callers serialise on a lock; the loser finds the cache filled.
set -euo pipefail

readonly K8S_VERSION=v1.20.2
# Go 1.18 and later miscompile the reflect2 copy vendored by this tree (see kube-apiserver.sh).
readonly GO_PKG_VERSION=1.15
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
readonly BINS=(kubelet kube-scheduler kube-controller-manager pause)

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
cache_dir="$cache_root/k8s-$K8S_VERSION-node"

log() { printf 'kube-node-bins.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# True when every file is in the cache.
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

# shellcheck source=scripts/cache-build.sh
source "$script_dir/cache-build.sh"
cache_lock "k8s-$K8S_VERSION-node"
if cache_complete; then
	printf '%s\n' "$cache_dir"
	exit 0
fi
cache_workdir "k8s-$K8S_VERSION-node"

########################################################################################################
phase tools
missing=()
command -v rsync >/dev/null || missing+=(rsync)
command -v make >/dev/null || missing+=(make)
command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
command -v gcc >/dev/null || missing+=(gcc)
# The static C library, for pause.
[[ -e /usr/lib/x86_64-linux-gnu/libc.a || -e /usr/lib/libc.a ]] || missing+=(libc6-dev)
for tool in apt-get dpkg flock realpath sha256sum tar; do
	command -v "$tool" >/dev/null || die "$tool not found; this script needs a Debian-based system"
done
[[ -r $KEYRING ]] || die "$KEYRING missing (package debian-archive-keyring); cannot verify the Debian archive"
if ((${#missing[@]})); then
	[[ $(id -u) -eq 0 ]] || die "missing ${missing[*]}; install them (apt-get install ${missing[*]}) or run as root"
	log "installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
		apt-get update -q >&2 || die "apt-get update failed"
		apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 || die "cannot install ${missing[*]}"
	fi
fi

########################################################################################################
phase apt-index
# shellcheck source=scripts/debian-mirror.sh
source "$script_dir/debian-mirror.sh"
mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")
mirror=${mirror%/}
bullseye_mirror=${KILOTUN_BULLSEYE_MIRROR:-$mirror}
bullseye_mirror=${bullseye_mirror%/}
log "Debian mirror: $mirror (bullseye: $bullseye_mirror)"

private_apt "$work/apt" \
	"deb-src [signed-by=$KEYRING] $mirror bookworm main" \
	"deb [signed-by=$KEYRING] $bullseye_mirror bullseye main"
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

########################################################################################################
phase unpack
shopt -s nullglob
dscs=("$dl"/kubernetes_*.dsc)
((${#dscs[@]} == 1)) || die "expected one kubernetes_*.dsc in $dl, found ${#dscs[@]}"
src="$work/src"
# --no-check: apt verified the files against the signed Sources index.
dpkg-source -x --no-check "${dscs[0]}" "$src" >&2 || die "dpkg-source could not unpack ${dscs[0]}"
grep -q "tag: $K8S_VERSION'" "$src/hack/lib/version.sh" ||
	die "the kubernetes source package is not upstream $K8S_VERSION (hack/lib/version.sh)"
root="$work/root"
mkdir -p "$root"
for deb in "$dl"/*.deb; do
	dpkg -x "$deb" "$root" || die "dpkg -x $deb failed"
done
goroot="$root/usr/lib/go-$GO_PKG_VERSION"
[[ -x $goroot/bin/go ]] || die "golang-$GO_PKG_VERSION-go did not contain $goroot/bin/go"

########################################################################################################
phase build
# Offline, pure-Go build (see kube-apiserver.sh). CGO_ENABLED=0 also for the kubelet, which the
# Kubernetes build would otherwise link with cgo: the test nodes need nothing cgo brings.
build_env=(
	env -u GOBIN -u GOPATH -u GOCACHE -u GOMODCACHE -u GO111MODULE
	"GOROOT=$goroot"
	"PATH=$goroot/bin:$PATH"
	"HOME=$work/home"
	GOPROXY=off
	GOFLAGS=
	GOSUMDB=off
	CGO_ENABLED=0
)
mkdir -p "$work/home"
"${build_env[@]}" go version >&2 || die "the unpacked Go toolchain does not run"
# The controller-manager and the scheduler import pkg/generated/openapi, which the release tree
# does not contain.
(cd "$src" && "${build_env[@]}" make gen_openapi >&2) || die "make gen_openapi failed"
(cd "$src" && "${build_env[@]}" hack/make-rules/build.sh \
	cmd/kubelet cmd/kube-scheduler cmd/kube-controller-manager >&2) ||
	die "building cmd/kubelet, cmd/kube-scheduler and cmd/kube-controller-manager failed"
for b in kubelet kube-scheduler kube-controller-manager; do
	[[ -x $src/_output/bin/$b ]] || die "the build did not produce $src/_output/bin/$b"
done

########################################################################################################
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

########################################################################################################
phase install
stage="$work/out"
mkdir -p "$stage/bin" "$stage/images"
for b in kubelet kube-scheduler kube-controller-manager; do
	cp "$src/_output/bin/$b" "$stage/bin/$b"
done
cp "$work/pause" "$stage/bin/pause"
chmod 0755 "$stage/bin/"*
tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner --format=posix \
	-cf "$stage/images/pause.oci.tar" -C "$oci" .
printf '%s\n' "$pause_image" >"$stage/PAUSE_IMAGE"

# Check that each binary runs and is the version we want.
{
	for b in kubelet kube-scheduler kube-controller-manager; do
		v=$("$stage/bin/$b" --version 2>&1) || die "the built $b does not run"
		[[ $v == "Kubernetes $K8S_VERSION" ]] || die "$b reports '$v', expected 'Kubernetes $K8S_VERSION'"
		echo "$b: $v (source: $(basename "${dscs[0]}" .dsc), $("${build_env[@]}" go version))"
	done
	v=$("$stage/bin/pause" -v 2>&1) || die "the built pause does not run"
	echo "pause: $v ($pause_image, $manifest_digest; ${pause_c#"$src"/}, $(gcc --version | head -n1))"
} >"$stage/VERSIONS"
cat "$stage/VERSIONS" >&2

# Publish atomically.
if [[ -e $cache_dir ]]; then
	mv "$cache_dir" "$work/old-cache"
fi
mv -T "$stage" "$cache_dir"

########################################################################################################
phase cleanup
cache_workdir_remove
trap - EXIT
phase ''
log "total: $((SECONDS - total_start))s; cache $(du -sh "$cache_dir" | cut -f1) in $cache_dir"
printf '%s\n' "$cache_dir"
