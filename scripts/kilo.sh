#!/usr/bin/env bash
# Build, once, upstream Kilo's `kg` and `kgctl` (github.com/squat/kilo) for the tests that run real
# Kilo next to kilotun (tests/real/real_kube/kilo_peer.rs), and cache them outside the repository.
#
#   scripts/kilo.sh        # prints (last line of stdout) the cache directory
#
# The cache directory, ${KILOTUN_CACHE:-/var/cache/kilotun}/kilo-<version>, holds
#   bin/kg, bin/kgctl  built from Kilo's source tree with its vendor/ (-mod=vendor, GOPROXY=off:
#                      offline), with Go 1.25 from Debian trixie-backports (golang-1.25-go and
#                      golang-1.25-src, downloaded and unpacked with dpkg -x, never installed)
#   VERSIONS           the Kilo version, source commit and Go toolchain
# <version> is `git describe --tags --always` of the source (for a plain directory, the content of
# its VERSION file, else "src"). If both binaries are already there the script only prints the path.
#
# Kilo is not in the Debian archive, so its source must already be on the machine:
#   KILOTUN_KILO_SRC       Kilo's source: a work tree, or a git directory (bare or .git), whose HEAD
#                          is built (default /work/.mirror/squat+kilo/repo)
#   KILOTUN_CACHE          cache root (default /var/cache/kilotun); must be outside the repository
#   KILOTUN_DEBIAN_MIRROR  Debian mirror (default: the one this machine's apt uses for bookworm; the
#                          same host serves trixie-backports)
#
# apt runs with a private configuration (its own sources list, index and download directories
# under a temporary directory): the machine's apt setup is neither read for sources nor changed.
# Concurrent callers serialise on a lock; the loser finds the cache filled. Publication is atomic.
set -euo pipefail

readonly GO_PKG_VERSION=1.25
readonly GO_SUITE=trixie-backports
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
readonly BINS=(kg kgctl)
readonly KILO_PKG=github.com/squat/kilo

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
kilo_src=${KILOTUN_KILO_SRC:-/work/.mirror/squat+kilo/repo}

log() { printf 'kilo.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

[[ -e $kilo_src ]] || die "no Kilo source at $kilo_src (Kilo is not in the Debian archive: clone github.com/squat/kilo and set KILOTUN_KILO_SRC)"

# Which kind of source, and its version.
if git -C "$kilo_src" rev-parse --git-dir >/dev/null 2>&1; then
	src_kind=git
	src_commit=$(git -C "$kilo_src" rev-parse HEAD) || die "$kilo_src: no HEAD commit"
	kilo_version=$(git -C "$kilo_src" describe --tags --always HEAD 2>/dev/null || echo "${src_commit:0:12}")
	[[ $(git -C "$kilo_src" rev-parse --is-bare-repository) == true ]] || {
		# A work tree with local changes is built as it stands: mark the version.
		[[ -z $(git -C "$kilo_src" status --porcelain 2>/dev/null) ]] || kilo_version+=-dirty
	}
else
	src_kind=dir
	src_commit=unknown
	kilo_version=$(cat "$kilo_src/VERSION" 2>/dev/null || echo src)
fi
cache_dir="$cache_root/kilo-$kilo_version"

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
cache_lock "kilo-$kilo_version"
if cache_complete; then
	printf '%s\n' "$cache_dir"
	exit 0
fi
cache_workdir "kilo-$kilo_version"

########################################################################################################
phase tools
for tool in apt-get dpkg flock realpath tar; do
	command -v "$tool" >/dev/null || die "$tool not found; this script needs a Debian-based system"
done
[[ $src_kind == dir ]] || command -v git >/dev/null || die "git not found (needed to export $kilo_src)"
[[ -r $KEYRING ]] || die "$KEYRING missing (package debian-archive-keyring); cannot verify the Debian archive"

########################################################################################################
phase source
src="$work/src"
mkdir -p "$src"
if [[ $src_kind == git ]]; then
	git -C "$kilo_src" archive --format=tar HEAD | tar -x -C "$src" || die "cannot export HEAD of $kilo_src"
else
	cp -a "$kilo_src/." "$src/"
fi
if [[ ! -f $src/go.mod ]] || ! grep -q "^module $KILO_PKG\$" "$src/go.mod"; then
	die "$kilo_src is not Kilo's source (go.mod is not module $KILO_PKG)"
fi
[[ -f $src/vendor/modules.txt ]] || die "$kilo_src has no vendor/ (the build is offline: -mod=vendor)"
go_req=$(awk '$1 == "go" { print $2; exit }' "$src/go.mod")
log "Kilo $kilo_version ($src_commit), go.mod wants go $go_req"

########################################################################################################
phase apt-index
# shellcheck source=scripts/debian-mirror.sh
source "$script_dir/debian-mirror.sh"
mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")
log "Debian mirror: $mirror ($GO_SUITE)"
private_apt "$work/apt" "deb [signed-by=$KEYRING] $mirror $GO_SUITE main"
apt-get "${apt_opts[@]}" --error-on=any update >&2 ||
	die "apt-get update failed for $mirror ($GO_SUITE); set KILOTUN_DEBIAN_MIRROR"

########################################################################################################
phase download
dl="$work/dl"
mkdir -p "$dl"
(cd "$dl" && apt-get "${apt_opts[@]}" download \
	"golang-$GO_PKG_VERSION-go/$GO_SUITE" "golang-$GO_PKG_VERSION-src/$GO_SUITE" >&2) ||
	die "cannot download golang-$GO_PKG_VERSION-go / -src from $mirror $GO_SUITE"

########################################################################################################
phase unpack
root="$work/root"
mkdir -p "$root"
for deb in "$dl"/*.deb; do
	dpkg -x "$deb" "$root" || die "dpkg -x $deb failed"
done
goroot="$root/usr/lib/go-$GO_PKG_VERSION"
[[ -x $goroot/bin/go ]] || die "golang-$GO_PKG_VERSION-go did not contain $goroot/bin/go"

########################################################################################################
phase build
# Offline, static, pure-Go build. GOTOOLCHAIN=local: go.mod's `go` line must never make the go
# command look for another toolchain. GOFLAGS is set whole so the caller's cannot leak in.
build_env=(
	env -u GOBIN -u GOPATH -u GOMODCACHE -u GO111MODULE -u GOEXPERIMENT
	"GOROOT=$goroot"
	"PATH=$goroot/bin:$PATH"
	"HOME=$work/home"
	"GOPATH=$work/gopath"
	"GOCACHE=$work/gocache"
	GOPROXY=off
	GOSUMDB=off
	GOTOOLCHAIN=local
	GOFLAGS=-mod=vendor
	CGO_ENABLED=0
)
mkdir -p "$work/home"
go_version=$("${build_env[@]}" go version) || die "the unpacked Go toolchain does not run"
log "$go_version"
ldflags="-s -w -X $KILO_PKG/pkg/version.Version=$kilo_version"
stage="$work/out"
mkdir -p "$stage/bin"
for b in "${BINS[@]}"; do
	(cd "$src" && "${build_env[@]}" go build -trimpath -ldflags "$ldflags" -o "$stage/bin/$b" "./cmd/$b" >&2) ||
		die "building cmd/$b failed"
done

########################################################################################################
phase install
chmod 0755 "$stage/bin/"*
kg_version=$("$stage/bin/kg" --version 2>&1) || die "the built kg does not run"
[[ $kg_version == *"$kilo_version"* ]] || die "kg reports '$kg_version', expected $kilo_version"
"$stage/bin/kgctl" --help >/dev/null 2>&1 || die "the built kgctl does not run"
{
	echo "kilo: $kilo_version (commit $src_commit, from $kilo_src)"
	echo "kg --version: $kg_version"
	echo "go: $go_version ($(cd "$dl" && echo golang-"$GO_PKG_VERSION"-go_*.deb))"
} >"$stage/VERSIONS"
cat "$stage/VERSIONS" >&2
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
