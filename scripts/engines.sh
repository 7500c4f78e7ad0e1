#!/usr/bin/env bash
# Fetch, once, the other userspace WireGuard engines that bench/throughput.sh and
# tests/netns/interop.rs compare kilotun with, and cache them outside the repository:
#
#   scripts/engines.sh [ENGINE...]   # default: wireguard-go-2023 wireguard-go-2026 gotatun
#
# ENGINE is one of
#   wireguard-go-2023  wireguard-go 0.0.20231211 (TUN TSO/GRO, UDP GSO/GRO), Debian's
#                      bookworm-backports package, unpacked (dpkg -x), not installed, into
#                      CACHE/wireguard-go-0.0.20231211/usr/bin/wireguard-go
#   wireguard-go-2026  wireguard-go 0.0.20260522, the newest release, Debian's sid package,
#                      likewise in CACHE/wireguard-go-0.0.20260522/usr/bin/wireguard-go (sid's
#                      newer upload when sid has moved on; its VERSION file says which)
#   gotatun            Mullvad's gotatun 0.10.2 (`cargo install gotatun-cli`), in
#                      CACHE/gotatun-0.10.2/bin/gotatun
#   boringtun-cli      boringtun-cli 0.7.1 (`cargo install boringtun-cli`), in
#                      CACHE/boringtun-cli-0.7.1/bin/boringtun-cli
# where CACHE is ${KILOTUN_CACHE:-/var/cache/kilotun}. For each engine it prints one line,
# VARIABLE=PATH, on stdout (KILOTUN_WIREGUARD_GO_2023, KILOTUN_WIREGUARD_GO_2026, KILOTUN_GOTATUN, KILOTUN_BORINGTUN_CLI: the
# variables tests/netns/interop.rs and bench/throughput.sh read), so
# `export $(scripts/engines.sh)` works.
# An engine already in the cache is only printed: no lock, no network.
#
# apt runs with a private configuration (its own sources list, package lists and download
# directory under CACHE/apt-SUITE), so the machine's apt sources and lists are neither read for
# sources nor changed. The Debian mirror is the one this machine's apt uses for bookworm
# (KILOTUN_DEBIAN_MIRROR overrides it; with neither, it stops and says so).
#
# On a fresh 2-core machine the wireguard-go download takes seconds; gotatun and boringtun-cli are
# compiled (minutes, CPU-bound: run this under `nice` on a shared machine). Concurrent callers
# serialise on one lock per engine; the loser finds the cache filled.
set -euo pipefail

readonly WIREGUARD_GO_2023=0.0.20231211
readonly WIREGUARD_GO_2026=0.0.20260522
readonly GOTATUN_VERSION=0.10.2
readonly BORINGTUN_VERSION=0.7.1
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}

log() { printf 'engines.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

case "$(realpath -m "$cache_root")/" in
"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
esac

# Takes the lock for engine $1 (waiting for another caller if need be) on file descriptor 9.
lock() {
	mkdir -p "$cache_root" || die "cannot create $cache_root (set KILOTUN_CACHE to a writable directory)"
	exec 9>"$cache_root/.$1.lock"
	if ! flock -n 9; then
		log "another caller holds $cache_root/.$1.lock; waiting for it"
		flock 9
	fi
}

# The Debian mirror this machine uses (scripts/debian-mirror.sh).
# shellcheck source=scripts/debian-mirror.sh
source "$script_dir/debian-mirror.sh"
# shellcheck source=scripts/cache-build.sh
source "$script_dir/cache-build.sh"

# wireguard_go SUITE VERSION VARIABLE: Debian's wireguard-go VERSION from SUITE, unpacked.
wireguard_go() {
	local suite=$1 want=$2 variable=$3
	local dir="$cache_root/wireguard-go-$want"
	local bin="$dir/usr/bin/wireguard-go"
	if [[ ! -x $bin ]]; then
		lock "wireguard-go-$want"
	fi
	if [[ ! -x $bin ]]; then
		local start=$SECONDS mirror apt_dir work deb apt_opts
		for tool in apt-get dpkg flock; do
			command -v "$tool" >/dev/null || die "$tool not found; this needs a Debian-based system"
		done
		[[ -r $KEYRING ]] || die "$KEYRING missing (package debian-archive-keyring)"
		mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")
		apt_dir="$cache_root/apt-$suite"
		private_apt "$apt_dir" "deb [signed-by=$KEYRING] $mirror $suite main"
		log "wireguard-go $want from $mirror $suite"
		apt-get "${apt_opts[@]}" --error-on=any update >&2 ||
			die "apt-get update failed for $mirror $suite; set KILOTUN_DEBIAN_MIRROR"
		work=$(mktemp -d "$cache_root/.wireguard-go.XXXXXX")
		# shellcheck disable=SC2064 # expand $work now: it is local.
		trap "rm -rf '$work'" EXIT
		# The exact Debian version, so that a newer upload is not picked up silently.
		local version
		version=$(apt-cache "${apt_opts[@]}" madison wireguard-go |
			awk -v v="$want" '$3 ~ "^" v "-" { print $3; exit }')
		if [[ -z $version && $suite == sid ]]; then
			# sid keeps only its current upload: once it moves past the pinned release, take
			# that newer one (it stands in the pinned one's directory, VERSION says which).
			version=$(apt-cache "${apt_opts[@]}" madison wireguard-go | awk '{ print $3; exit }')
			if [[ -n $version ]] && dpkg --compare-versions "$version" ge "$want"; then
				log "sid no longer has wireguard-go $want; taking its $version instead"
			else
				version=
			fi
		fi
		[[ -n $version ]] || die "$suite on $mirror has no wireguard-go $want"
		(cd "$work" && apt-get "${apt_opts[@]}" download "wireguard-go=$version" >&2) ||
			die "cannot download wireguard-go=$version"
		deb=$(echo "$work"/wireguard-go_*.deb)
		dpkg -x "$deb" "$work/root" || die "dpkg -x $deb failed"
		# The package's version, not `wireguard-go --version`: upstream left version.go at
		# 0.0.20230223 in the 0.0.20231211 release, so that binary reports that.
		[[ $(dpkg-deb -f "$deb" Version) == "$version" ]] || die "$deb is not wireguard-go $version"
		[[ -x $work/root/usr/bin/wireguard-go ]] || die "$deb does not contain /usr/bin/wireguard-go"
		"$work/root/usr/bin/wireguard-go" --version >/dev/null || die "the unpacked wireguard-go does not run"
		echo "wireguard-go $version ($(basename "$deb"), $mirror $suite)" >"$work/root/VERSION"
		rm -rf "$dir"
		mv -T "$work/root" "$dir"
		rm -rf "$work"
		trap - EXIT
		log "wireguard-go $want: $((SECONDS - start)) s"
	fi
	echo "$variable=$bin"
}

# cargo_engine CRATE VERSION BINARY VARIABLE
cargo_engine() {
	local crate=$1 version=$2 binary=$3 variable=$4
	local dir="$cache_root/$binary-$version"
	local bin="$dir/bin/$binary"
	if [[ ! -x $bin ]]; then
		lock "$binary-$version"
	fi
	if [[ ! -x $bin ]]; then
		local start=$SECONDS
		command -v cargo >/dev/null || die "cargo not found; $binary $version is built from crates.io"
		log "$binary $version: cargo install $crate --version $version --locked"
		# --locked: the dependency versions the release was published with.
		# Its own temporary target directory, not a shared CARGO_TARGET_DIR (whose lock would make
		# it wait for, or hold up, a concurrent build of the workspace).
		env -u CARGO_TARGET_DIR -u CARGO_BUILD_TARGET_DIR \
			cargo install --quiet --locked --root "$dir" "$crate" --version "=$version" >&2 ||
			die "cargo install $crate $version failed"
		[[ -x $bin ]] || die "cargo install $crate did not produce $bin"
		log "$binary $version: $((SECONDS - start)) s"
	fi
	echo "$variable=$bin"
}

engines=("$@")
((${#engines[@]})) || engines=(wireguard-go-2023 wireguard-go-2026 gotatun)
for engine in "${engines[@]}"; do
	case "$engine" in
	wireguard-go-2023) wireguard_go bookworm-backports "$WIREGUARD_GO_2023" KILOTUN_WIREGUARD_GO_2023 ;;
	wireguard-go-2026) wireguard_go sid "$WIREGUARD_GO_2026" KILOTUN_WIREGUARD_GO_2026 ;;
	gotatun) cargo_engine gotatun-cli "$GOTATUN_VERSION" gotatun KILOTUN_GOTATUN ;;
	boringtun-cli) cargo_engine boringtun-cli "$BORINGTUN_VERSION" boringtun-cli KILOTUN_BORINGTUN_CLI ;;
	*) die "unknown engine $engine (wireguard-go-2023, wireguard-go-2026, gotatun or boringtun-cli)" ;;
	esac
done
