#!/usr/bin/env bash
# Build, once, a real Kubernetes v1.20.2 control plane for tests and cache it outside the repository.
#
#   scripts/kube-apiserver.sh        # prints (last line of stdout) the cache directory
#
# The cache directory, ${KILOTUN_CACHE:-/var/cache/kilotun}/k8s-v1.20.2, holds
#   bin/kube-apiserver  built from Debian bookworm's source package `kubernetes` (upstream v1.20.2
#                       with vendor/), with Go 1.15 from Debian bullseye
#   bin/etcd            from bookworm's etcd-server (3.4.x), unpacked, not installed
#   bin/kubectl         from bookworm's kubernetes-client (v1.20.2), unpacked, not installed
#   VERSIONS            what each binary reports and which Debian packages it came from
# If the three binaries are already there the script only prints the path.
#
# Everything comes from the Debian archive, so it works on a machine that reaches only Debian's
# mirror. apt runs with a private configuration (its own sources list, index and download
# directories under a temporary directory), so the machine's apt setup is neither read for
# sources nor changed. Only `rsync`, `make` and `dpkg-dev`, when missing, are installed
# system-wide (the Kubernetes build scripts and dpkg-source need them).
#
# Environment:
#   KILOTUN_CACHE            cache root (default /var/cache/kilotun); must be outside the repository
#   KILOTUN_DEBIAN_MIRROR    Debian mirror for bookworm (default: the one this machine's apt uses;
#                            with neither, the script stops and says so)
#   KILOTUN_BULLSEYE_MIRROR  Debian mirror for bullseye's Go 1.15 (default: the bookworm mirror)
#
# The first run takes a few minutes (the kube-apiserver build is CPU-bound; run it under `nice` on
# a shared machine). Concurrent callers serialise on a lock; the loser finds the cache filled.
set -euo pipefail

readonly K8S_VERSION=v1.20.2
# Go 1.18 and later miscompile the reflect2 copy vendored by this tree, so the toolchain is pinned
# to the Go 1.15 that Kubernetes 1.20 was released with (Debian bullseye's golang-1.15).
readonly GO_PKG_VERSION=1.15
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
readonly BINS=(kube-apiserver etcd kubectl)

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
cache_dir="$cache_root/k8s-$K8S_VERSION"

log() { printf 'kube-apiserver.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

# True when every binary is in the cache and executable.
cache_complete() {
	local b
	for b in "${BINS[@]}"; do
		[[ -x "$cache_dir/bin/$b" ]] || return 1
	done
}

# Fast path: nothing to do, no lock, no network.
if cache_complete; then
	printf '%s\n' "$cache_dir"
	exit 0
fi

# shellcheck source=scripts/cache-build.sh
source "$script_dir/cache-build.sh"
cache_lock "k8s-$K8S_VERSION"
if cache_complete; then
	printf '%s\n' "$cache_dir"
	exit 0
fi
cache_workdir "k8s-$K8S_VERSION"

########################################################################################################
phase tools
# The Kubernetes build uses rsync (placing binaries) and make; dpkg-source comes with dpkg-dev.
missing=()
command -v rsync >/dev/null || missing+=(rsync)
command -v make >/dev/null || missing+=(make)
command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
for tool in apt-get dpkg flock realpath; do
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

private_apt "$work/apt" \
	"deb-src [signed-by=$KEYRING] $mirror bookworm main" \
	"deb [signed-by=$KEYRING] $mirror bookworm main" \
	"deb [signed-by=$KEYRING] $bullseye_mirror bullseye main"
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
	"golang-$GO_PKG_VERSION-go/bullseye" "golang-$GO_PKG_VERSION-src/bullseye" \
	etcd-server/bookworm kubernetes-client/bookworm >&2) ||
	die "cannot download golang-$GO_PKG_VERSION (bullseye), etcd-server or kubernetes-client (bookworm)"

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
[[ -x $root/usr/bin/etcd ]] || die "etcd-server did not contain /usr/bin/etcd"
[[ -x $root/usr/bin/kubectl ]] || die "kubernetes-client did not contain /usr/bin/kubectl"

########################################################################################################
phase build
# Offline, pure-Go build with the unpacked Go 1.15 (GOROOT must be explicit because the toolchain
# is not at its packaged path). GOPROXY=off and the tree's vendor/ keep it off the network;
# GOFLAGS is cleared so the caller's settings (-mod=mod, for example) cannot leak in.
# hack/lib sets GOPATH and GOCACHE under _output/ in the source tree, so the Go build cache goes
# away with it.
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
# kube-apiserver imports pkg/generated/openapi, which the release tree does not contain; generate
# it first, then build only kube-apiserver.
(cd "$src" && "${build_env[@]}" make gen_openapi >&2) || die "make gen_openapi failed"
(cd "$src" && "${build_env[@]}" hack/make-rules/build.sh cmd/kube-apiserver >&2) ||
	die "building cmd/kube-apiserver failed"
apiserver="$src/_output/bin/kube-apiserver"
[[ -x $apiserver ]] || die "the build did not produce $apiserver"

########################################################################################################
phase install
stage="$work/out"
mkdir -p "$stage/bin"
cp "$apiserver" "$stage/bin/kube-apiserver"
cp "$root/usr/bin/etcd" "$stage/bin/etcd"
cp "$root/usr/bin/kubectl" "$stage/bin/kubectl"
chmod 0755 "$stage/bin/"*

# Check that each binary runs and is the version we want.
apiserver_version=$("$stage/bin/kube-apiserver" --version) || die "the built kube-apiserver does not run"
[[ $apiserver_version == "Kubernetes $K8S_VERSION" ]] ||
	die "kube-apiserver reports '$apiserver_version', expected 'Kubernetes $K8S_VERSION'"
kubectl_version=$("$stage/bin/kubectl" version --client --short) || die "kubectl does not run"
[[ $kubectl_version == *"$K8S_VERSION"* ]] || die "kubectl reports '$kubectl_version', expected $K8S_VERSION"
etcd_version=$("$stage/bin/etcd" --version | head -n1) || die "etcd does not run"
{
	echo "kube-apiserver: $apiserver_version (source: $(basename "${dscs[0]}" .dsc), $("${build_env[@]}" go version))"
	echo "kubectl: $kubectl_version ($(cd "$dl" && echo kubernetes-client_*.deb))"
	echo "etcd: $etcd_version ($(cd "$dl" && echo etcd-server_*.deb))"
} >"$stage/VERSIONS"
cat "$stage/VERSIONS" >&2

# Publish atomically: a half-filled cache directory (someone removed a binary) is replaced whole.
if [[ -e $cache_dir ]]; then
	mv "$cache_dir" "$work/old-cache"
fi
mv -T "$stage" "$cache_dir"

########################################################################################################
phase cleanup
# The source tree, Go toolchain, downloads and Go build cache are all under $work.
cache_workdir_remove
trap - EXIT
phase ''
log "total: $((SECONDS - total_start))s; cache $(du -sh "$cache_dir" | cut -f1) in $cache_dir"
printf '%s\n' "$cache_dir"
