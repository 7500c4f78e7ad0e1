#!/usr/bin/env bash
# Cross-build kg, kgctl and kilotun for 64-bit and 32-bit ARM, and run tests there under qemu-user:
#
#   scripts/cross-build.sh [--target arm64|armv7|all] [--profile release|ci|dev|NAME]
#   scripts/cross-build.sh [--target ...] [--profile ...] --test [CARGO-TEST-ARGS...]
#   scripts/cross-build.sh [--target ...] [--profile ...] --cargo COMMAND [ARGS...]
#   scripts/cross-build.sh [--target ...] --prepare
#
# The first form builds the three binaries into target/<triple>/<profile dir>/ (target/
# aarch64-unknown-linux-gnu/release/kg, ...), checks what each needs of the C library (readelf -V:
# every symbol version must exist in the bookworm sysroot, so the highest GLIBC_ is at most 2.36;
# the build fails otherwise) and prints the sizes. The second form runs `cargo test` for the target
# with CARGO-TEST-ARGS (for example `-p dataplane -p control --lib`), each test binary under
# `qemu-aarch64-static -L <sysroot>` (or qemu-arm-static), i.e. against bookworm's glibc. The
# third runs any other cargo command the same way (`--cargo check --workspace --all-targets`).
# --prepare only creates the toolchain and sysroots (below) when missing.
#
# Targets: arm64 = aarch64-unknown-linux-gnu, armv7 = armv7-unknown-linux-gnueabihf; default all.
# Profile: default release (fat LTO, see Cargo.toml); `ci` is release without LTO, what CI builds.
#
# The toolchain is Debian's (rustup cannot download a target's std here): a Debian sid chroot with
# rustc, cargo, libstd-rust-dev:arm64/:armhf and the cross gccs, plus two bookworm libc6-dev
# sysroots (arm64, armhf) that the binaries link against, so they run on bookworm-era glibc (sid's
# own cross glibc would make them need GLIBC_2.39 and later). They are created once, with
# mmdebstrap, under ${KILOTUN_CACHE:-/var/cache/kilotun}/cross (about 2.2 GB, a few minutes) and
# reused; delete a directory there to recreate it. The Debian mirror is the one this machine's apt
# uses for bookworm (KILOTUN_DEBIAN_MIRROR overrides it; scripts/debian-mirror.sh). The suite of
# the chroot is sid (KILOTUN_CROSS_SUITE overrides it, e.g. with a stable release whose rustc is
# at least the workspace's rust-version). mmdebstrap keeps its apt configuration inside the
# directories it creates: the machine's apt sources, lists and settings are not touched.
#
# cargo runs inside the chroot (in a private mount namespace: nothing stays mounted afterwards)
# with the repository at the same path, the machine's cargo registry (${CARGO_HOME:-~/.cargo}/
# registry) so crates are not downloaded again, and its intermediate files in target/cross/ (cargo's
# build-dir), apart from the host's target/release. Variables CARGO_PROFILE_*, CARGO_BUILD_JOBS,
# CARGO_TERM_*, RUST_BACKTRACE, RUST_LOG, KILOTUN_* and CI are passed to it, so
# `CARGO_PROFILE_RELEASE_LTO=thin scripts/cross-build.sh` works.
#
# Needs root (mmdebstrap --mode=root, chroot, mount), and the packages mmdebstrap, util-linux,
# binutils, and for --test qemu-user-static. Building needs no binfmt_misc; running a foreign
# binary directly (tests/real/cross_arch.rs does, through `ip netns exec`) does, and --test mounts
# binfmt_misc if it is not mounted. Concurrent callers share one lock per cache: creation is
# exclusive, builds share it.
set -euo pipefail

readonly MAX_GLIBC=2.36
readonly CHROOT_PACKAGES=rustc,cargo,gcc,libc6-dev,ca-certificates,libstd-rust-dev:arm64,libstd-rust-dev:armhf,gcc-aarch64-linux-gnu,gcc-arm-linux-gnueabihf,binutils-aarch64-linux-gnu,binutils-arm-linux-gnueabihf

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
cross_dir=$cache_root/cross
suite=${KILOTUN_CROSS_SUITE:-sid}
chroot_dir=$cross_dir/$suite
# shellcheck source=scripts/private-mounts.sh
source "$script_dir/private-mounts.sh"

log() { printf 'cross-build.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
usage() {
	sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
	exit "${1:-0}"
}

targets=all
profile=release
test_mode=
prepare=
cargo_command=
test_args=()
while (($#)); do
	case "$1" in
	--target) targets=${2:?--target needs arm64, armv7 or all}; shift 2 ;;
	--target=*) targets=${1#*=}; shift ;;
	--profile) profile=${2:?--profile needs a name}; shift 2 ;;
	--profile=*) profile=${1#*=}; shift ;;
	--test) test_mode=1; cargo_command="test"; shift; test_args=("$@"); break ;;
	--cargo) test_mode=1; cargo_command=${2:?--cargo needs a cargo command}; shift 2; test_args=("$@"); break ;;
	--prepare) prepare=1; shift ;;
	-h | --help) usage 0 ;;
	*) log "unknown argument $1"; usage 2 ;;
	esac
done
case "$targets" in
arm64 | armv7) ;;
all) targets="arm64 armv7" ;;
*) die "--target must be arm64, armv7 or all (not $targets)" ;;
esac
case "$profile" in
dev | test) profile_dir=debug ;;
bench) profile_dir=release ;;
*) profile_dir=$profile ;;
esac

# triple, GNU prefix, Debian architecture, qemu binary of each target.
triple_of() { case "$1" in arm64) echo aarch64-unknown-linux-gnu ;; armv7) echo armv7-unknown-linux-gnueabihf ;; esac }
gnu_of() { case "$1" in arm64) echo aarch64-linux-gnu ;; armv7) echo arm-linux-gnueabihf ;; esac }
debarch_of() { case "$1" in arm64) echo arm64 ;; armv7) echo armhf ;; esac }
qemu_of() { case "$1" in arm64) echo qemu-aarch64-static ;; armv7) echo qemu-arm-static ;; esac }

# need COMMAND PACKAGE
need() { command -v "$1" >/dev/null || die "$1 not found: install the Debian package $2 (apt-get install $2)"; }

[[ $(id -u) == 0 ]] || die "needs root (mmdebstrap --mode=root, chroot and bind mounts)"
case "$(realpath -m "$cache_root")/" in
"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
esac
need flock util-linux
need unshare util-linux
need readelf binutils
if [[ -n $test_mode ]]; then
	for t in $targets; do need "$(qemu_of "$t")" qemu-user-static; done
fi
cargo_home=${CARGO_HOME:-$HOME/.cargo}

mkdir -p "$cross_dir" || die "cannot create $cross_dir (set KILOTUN_CACHE to a writable directory)"
exec 9>"$cross_dir/.lock"

# create_root KIND DIR SUITE MMDEBSTRAP-OPTIONS...: runs mmdebstrap into a temporary directory
# beside DIR, then renames it, so an interrupted run leaves no half-made DIR. KIND names it in
# messages.
create_root() {
	local kind=$1 dir=$2 suite=$3 work start=$SECONDS
	shift 3
	need mmdebstrap mmdebstrap
	need arch-test arch-test
	work=$(mktemp -d "$cross_dir/.tmp.XXXXXX")
	# shellcheck disable=SC2064 # expand $work now.
	trap "remove_tree '$work'" EXIT
	log "creating $kind in $dir (mmdebstrap $* $suite $mirror)"
	if ! in_private_mounts mmdebstrap --mode=root --quiet --aptopt='Acquire::Check-Valid-Until "false"' \
		--aptopt='Acquire::Languages "none"' "$@" "$suite" "$work/root" "$mirror" >"$work/log" 2>&1; then
		tail -30 "$work/log" >&2
		die "mmdebstrap failed for $kind (above); the mirror is $mirror (KILOTUN_DEBIAN_MIRROR overrides it)"
	fi
	remove_tree "$dir"
	mv -T "$work/root" "$dir"
	remove_tree "$work"
	trap - EXIT
	log "$kind: $((SECONDS - start)) s, $(du -sh "$dir" | cut -f1)"
}

chroot_ready() {
	local f
	for f in usr/bin/rustc usr/bin/cargo usr/bin/aarch64-linux-gnu-gcc usr/bin/arm-linux-gnueabihf-gcc \
		usr/lib/rustlib/aarch64-unknown-linux-gnu/lib usr/lib/rustlib/armv7-unknown-linux-gnueabihf/lib; do
		[[ -e $chroot_dir/$f ]] || return 1
	done
}
sysroot_ready() { [[ -e $cross_dir/sysroot-$1/usr/lib/$2/libc.so && -e $cross_dir/sysroot-$1/lib/$2/libgcc_s.so.1 ]]; }

missing=
chroot_ready || missing=1
for t in $targets; do sysroot_ready "$(debarch_of "$t")" "$(gnu_of "$t")" || missing=1; done
if [[ -n $missing ]]; then
	if ! flock -n 9; then
		log "another caller holds $cross_dir/.lock; waiting for it"
		flock 9
	fi
	# shellcheck source=scripts/debian-mirror.sh
	source "$script_dir/debian-mirror.sh"
	mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")
	if ! chroot_ready; then
		create_root "the $suite toolchain chroot" "$chroot_dir" "$suite" --variant=apt \
			--architectures=amd64,arm64,armhf --include="$CHROOT_PACKAGES"
		chroot_ready || die "$chroot_dir lacks rustc, cargo, a cross gcc or a target's Rust std (libstd-rust-dev:arm64/:armhf)"
	fi
	for t in $targets; do
		a=$(debarch_of "$t")
		if ! sysroot_ready "$a" "$(gnu_of "$t")"; then
			# extract: libc6-dev and its dependencies unpacked, nothing run (no emulation needed).
			create_root "the bookworm $a sysroot" "$cross_dir/sysroot-$a" bookworm --variant=extract \
				--architectures="$a" --include=libc6-dev
			sysroot_ready "$a" "$(gnu_of "$t")" || die "$cross_dir/sysroot-$a lacks libc.so or libgcc_s.so.1"
		fi
	done
fi
# Builds share the lock: nobody recreates the chroot under them.
flock -s 9
log "toolchain: $(chroot "$chroot_dir" rustc -V) in $chroot_dir"
[[ -z $prepare ]] || exit 0

if [[ -n $test_mode ]]; then
	# The qemu-user binaries run the tests (the cargo runner); binfmt_misc lets a test exec a
	# foreign binary directly (a child process, or `ip netns exec`).
	if [[ ! -e /proc/sys/fs/binfmt_misc/status ]]; then
		mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc ||
			log "warning: could not mount binfmt_misc; tests that exec a foreign binary directly will fail"
	fi
	for t in $targets; do
		q=$(qemu_of "$t")
		[[ -e /proc/sys/fs/binfmt_misc/${q%-static} ]] ||
			log "warning: no binfmt_misc entry ${q%-static} (install qemu-user-static, which registers it, or run update-binfmts --enable ${q%-static})"
	done
fi

# The command run inside the chroot, per target: variables, then cargo.
inner=$(mktemp "$chroot_dir/tmp/cross-build.XXXXXX")
trap 'rm -f "$inner"' EXIT
{
	echo 'set -euo pipefail'
	echo "cd $(printf %q "$repo_root")"
	echo "export CARGO_BUILD_BUILD_DIR=$(printf %q "$repo_root/target/cross")"
	# Passed through from the caller.
	while IFS='=' read -r -d '' name value; do
		case "$name" in
		CARGO_PROFILE_* | CARGO_BUILD_JOBS | CARGO_BUILD_BUILD_DIR | CARGO_TERM_* | CARGO_INCREMENTAL | RUST_BACKTRACE | RUST_LOG | RUST_TEST_THREADS | KILOTUN_* | CI)
			printf 'export %s=%q\n' "$name" "$value"
			;;
		esac
	done < <(env -0)
	for t in $targets; do
		triple=$(triple_of "$t")
		gnu=$(gnu_of "$t")
		sysroot=/opt/sysroot-$(debarch_of "$t")
		var=${triple^^}
		var=${var//-/_}
		# --sysroot alone still finds the cross glibc (/usr/$gnu/lib) first: -B and -L put the
		# bookworm crt files and libraries ahead of it.
		echo "export CARGO_TARGET_${var}_LINKER=$gnu-gcc"
		echo "export CARGO_TARGET_${var}_RUSTFLAGS='-C link-arg=--sysroot=$sysroot -C link-arg=-B$sysroot/usr/lib/$gnu -C link-arg=-L$sysroot/usr/lib/$gnu -C link-arg=-L$sysroot/lib/$gnu'"
		echo "export CARGO_TARGET_${var}_RUNNER='$(qemu_of "$t") -L $sysroot'"
		# ring's C and assembly: the bookworm headers too.
		echo "export CC_${triple//-/_}=$gnu-gcc AR_${triple//-/_}=$gnu-ar CFLAGS_${triple//-/_}='--sysroot=$sysroot'"
	done
	echo 'target=$1; shift'
	echo 'start=$SECONDS'
	echo 'cargo "$@"'
	echo 'echo "cross-build.sh: cargo ${1} for $target: $((SECONDS - start)) s" >&2'
} >"$inner"

# in_chroot CARGO-ARGS...: runs cargo inside the chroot in a private mount namespace.
in_chroot() {
	local triple=$1
	shift
	local mounts
	mounts=$(
		printf 'set -e\n'
		printf 'mount -t proc proc %q\n' "$chroot_dir/proc"
		printf 'mount --rbind /dev %q\n' "$chroot_dir/dev"
		printf 'mount --rbind /sys %q\n' "$chroot_dir/sys"
		printf 'mkdir -p %q %q %q\n' "$chroot_dir$repo_root" "$chroot_dir/root/.cargo/registry" "$cargo_home/registry"
		printf 'mount --bind %q %q\n' "$repo_root" "$chroot_dir$repo_root"
		printf 'mount --bind %q %q\n' "$cargo_home/registry" "$chroot_dir/root/.cargo/registry"
		for a in arm64 armhf; do
			[[ -d $cross_dir/sysroot-$a ]] || continue
			printf 'mkdir -p %q\n' "$chroot_dir/opt/sysroot-$a"
			printf 'mount --bind -o ro %q %q\n' "$cross_dir/sysroot-$a" "$chroot_dir/opt/sysroot-$a"
		done
		for q in qemu-aarch64-static qemu-arm-static; do
			command -v $q >/dev/null || continue
			printf 'touch %q\n' "$chroot_dir/usr/local/bin/$q"
			printf 'mount --bind -o ro %q %q\n' "$(command -v $q)" "$chroot_dir/usr/local/bin/$q"
		done
		printf 'cp -L /etc/resolv.conf %q 2>/dev/null || true\n' "$chroot_dir/etc/resolv.conf"
		printf 'exec chroot %q /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin TERM=%q CARGO_HOME=/root/.cargo bash %q "$@"\n' \
			"$chroot_dir" "${TERM:-dumb}" "${inner#"$chroot_dir"}"
	)
	unshare --mount --propagation private -- bash -c "$mounts" cross-build "$triple" "$@"
}

# check_binary TRIPLE FILE: every symbol version FILE needs must be defined by the library of that
# name in the bookworm sysroot; prints the highest GLIBC_ and fails past MAX_GLIBC.
check_binary() {
	local t=$1 file=$2 sysroot gnu
	sysroot=$cross_dir/sysroot-$(debarch_of "$1")
	gnu=$(gnu_of "$t")
	local needs max bad=0 lib ver
	needs=$(readelf -V --wide "$file" | awk '
		/^Version needs section/ { on = 1; next }
		/^Version (definition|symbols) section/ { on = 0 }
		on && /File:/ { for (i = 1; i <= NF; i++) if ($i == "File:") lib = $(i + 1) }
		on && /Name:/ { for (i = 1; i <= NF; i++) if ($i == "Name:") print lib, $(i + 1) }')
	max=$(awk '$2 ~ /^GLIBC_[0-9]/ { sub(/^GLIBC_/, "", $2); print $2 }' <<<"$needs" | sort -V | tail -1)
	while read -r lib ver; do
		[[ -n $lib ]] || continue
		local path=$sysroot/lib/$gnu/$lib
		[[ -e $path ]] || path=$sysroot/usr/lib/$gnu/$lib
		if [[ ! -e $path ]]; then
			log "$file needs $lib, which the bookworm sysroot lacks"
			bad=1
		elif ! grep -qx "Name: $ver" <<<"$(readelf -V --wide "$(realpath "$path")" | grep -o 'Name: [^ ]*')"; then
			log "$file needs $ver of $lib, which bookworm's $lib does not define"
			bad=1
		fi
	done <<<"$needs"
	if [[ -n $max ]] && [[ $(printf '%s\n%s\n' "$max" "$MAX_GLIBC" | sort -V | tail -1) != "$MAX_GLIBC" ]]; then
		log "$file needs GLIBC_$max, past bookworm's $MAX_GLIBC"
		bad=1
	fi
	echo "${max:-none}"
	return $bad
}

status=0
for t in $targets; do
	triple=$(triple_of "$t")
	if [[ -n $test_mode ]]; then
		in_chroot "$triple" "$cargo_command" --locked --target "$triple" --profile "$profile" "${test_args[@]}" || status=1
		continue
	fi
	in_chroot "$triple" build --locked --target "$triple" --profile "$profile" --bin kg --bin kgctl --bin kilotun ||
		die "cargo build failed for $triple"
	out=$repo_root/target/$triple/$profile_dir
	printf '%-40s %12s %12s  %s\n' "$triple/$profile_dir" bytes stripped max-GLIBC
	for bin in kg kgctl kilotun; do
		glibc=$(check_binary "$t" "$out/$bin") || status=1
		# The cross strip (the machine's binutils may not know the architecture), on a copy.
		stripped=$(mktemp "$chroot_dir/tmp/strip.XXXXXX")
		cp "$out/$bin" "$stripped"
		chroot "$chroot_dir" "$(gnu_of "$t")-strip" "${stripped#"$chroot_dir"}" || log "strip failed for $bin"
		printf '%-40s %12s %12s  %s\n' "  $bin" "$(stat -c %s "$out/$bin")" "$(stat -c %s "$stripped")" "GLIBC_$glibc"
		rm -f "$stripped"
	done
done
exit $status
