#!/usr/bin/env bash
# Run a command as root under one of Debian's own x86-64 kernels, booted in a virtual machine whose
# root file system is this machine's own (read-only, with writable tmpfs overlays):
#
#   scripts/kernel-vm.sh --kernel 6.1|5.10|sid [--timeout SECS] -- COMMAND...
#   scripts/kernel-vm.sh --kernel 6.1|5.10|sid --prepare   # only fill the cache
#
# Why: the machines CI runs on have a kernel of their own (Linux 6.18 here) built without the
# wireguard, ipip and dummy modules, so kg's kernel paths (the kernel's WireGuard device, IPIP
# encapsulation) and kilotun's interoperability with the kernel's WireGuard cannot be tested on
# them directly. Debian's kernels have all of those as modules: 6.1 is bookworm's, 5.10 bullseye's
# (an older long-term kernel: a second data point for the kernel interfaces kilotun and kg use),
# sid unstable's newest (7.2 when written: interfaces added since, such as WireGuard's removal of
# one allowed IP from 6.16). tests/real/kernel_vm.rs runs tests/kernel_vm_interop.sh under 6.1
# and 5.10, and netns tests under 5.10 and sid.
#
# The kernel is Debian's linux-image-<release>-amd64 package, the one linux-image-amd64 depends on
# in the suite (bookworm for 6.1, bullseye for 5.10, sid), fetched with `apt-get download` through a
# private apt configuration (its own sources list and package lists under the cache: the
# machine's apt sources and lists are neither read nor changed; the Debian mirror is the one this
# machine's apt uses for bookworm, KILOTUN_DEBIAN_MIRROR overrides it; scripts/debian-mirror.sh)
# and unpacked with `dpkg -x`, not installed, into
# ${KILOTUN_CACHE:-/var/cache/kilotun}/kernel-vm/<suite>-<kernel release>/ (boot/vmlinuz-*,
# lib/modules/<release>/ with the module index made by `depmod -b`; hardware modules a virtual
# machine has no use for are dropped). The directory is made in a temporary directory and renamed;
# a flock on kernel-vm/.lock makes preparing exclusive and runs share it. It is kept until deleted:
# delete it to pick up a newer kernel of the suite.
#
# The machine is virtme-ng (VIRTME_NG_VERSION below, from PyPI, pip-installed into a private
# virtual environment, kernel-vm/venv-virtme-ng-<version>/, made in place and marked complete at
# the end: a venv cannot be renamed): it boots the kernel with qemu-system-x86_64 (TCG: this
# machine's CPU has no VT-x, so no KVM), builds an initramfs of the virtio and 9p modules of the
# kernel's own module directory with this machine's busybox, and exports this machine's root file
# system to the guest over 9p (virtiofsd is not installed), read-only, with tmpfs-backed overlays
# on /etc, /usr, /var, /tmp, /home... so the guest can write without touching the host. The
# guest's /lib/modules/<release> is the cache's module directory (virtme-ng links it; this script
# exports the cache directory to the guest as well, because virtme-ng puts a tmpfs on /var/cache),
# so `modprobe wireguard` and the kernel's own module requests (`ip link add ... type wireguard`)
# work. virtme-ng rather than a hand-made qemu command line: its initramfs and init already solve
# the root-over-9p, module and overlay problems. Its console-less script channel needs udev, which
# this machine has not: the command's output therefore comes back on the serial console, between
# marker lines (`KILOTUN_VM_BEGIN run=<nonce>`, `KILOTUN_VM_EXIT=<n> run=<nonce>`), as
# scripts/arm64-vm.sh does, and the exit status is taken from the marker, not from vng.
#
# The guest runs COMMAND as root (even when this script is not) in this repository's directory
# (read-only unless it is under one of the overlaid directories, /tmp say), stdin from /dev/null,
# with tun loaded (nothing creates /dev/net/tun without it), KILOTUN_VM_KERNEL=<release> and CI
# (when set) in its environment. Its
# output (stdout and stderr merged) is printed on stdout as it comes; everything else (progress
# with timings, the boot console) goes to stderr. Exit status: COMMAND's; 124 when --timeout SECS
# (default 600, boot to power-off) passes first; 125 when the machine stops without reporting one;
# 1 for errors here, 2 for bad arguments. KILOTUN_VM_SMP (default 2) and KILOTUN_VM_MEMORY
# (default 2G) size the machine.
#
# Needs: qemu-system-x86 (qemu-system-x86_64), busybox-static, kmod (depmod for the cache, modprobe
# for virtme-ng's module lookup and in the guest), python3 with venv, apt-get and dpkg, util-linux,
# coreutils. Preparing needs root (or a writable cache), the network (Debian mirror, PyPI); running
# needs neither beyond read access to the cache (qemu runs as the caller, so the guest reads only
# what the caller may).
#
# Cost on a busy 2-core machine (load 7 to 9): preparing takes 12 to 27 s per kernel (apt-get
# update, 55 to 70 MB downloaded, 5 to 7 s of dpkg -x, depmod; 191 MB for 5.10, 233 MB for 6.1)
# and 10 to 25 s for the virtual environment, so about 75 s for both kernels on a fresh machine;
# a run spends about 8 s on this side (vng, the initramfs, firmware) and 13 to 25 s of guest boot
# under TCG (a third to a half of it systemd-tmpfiles, which virtme-ng's init runs) before COMMAND
# starts: `-- true` takes 23 to 35 s end to end with either kernel, and tests/kernel_vm_interop.sh
# 50 to 80 s under 6.1, 110 to 135 s under 5.10. See the timings on stderr.
set -euo pipefail

readonly VIRTME_NG_VERSION=1.42
readonly KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
readonly DEFAULT_TIMEOUT=600
# Kernel module directories dropped from the unpacked package: hardware a virtual machine has none
# of (about half of the modules' size). depmod runs afterwards.
readonly PRUNE_MODULES="kernel/drivers/gpu kernel/drivers/media kernel/drivers/net/wireless kernel/drivers/staging kernel/drivers/infiniband kernel/drivers/iio kernel/drivers/bluetooth kernel/sound kernel/net/wireless kernel/net/mac80211 kernel/net/bluetooth"

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
vm_root=$cache_root/kernel-vm
smp=${KILOTUN_VM_SMP:-2}
memory=${KILOTUN_VM_MEMORY:-2G}

# --- logging with timings -------------------------------------------------------------------------
# now_ms, secs, log, die, usage, step, quietly, need.
# shellcheck source=scripts/timed-log.sh
source "$(dirname "${BASH_SOURCE[0]}")/timed-log.sh"

# --- arguments ------------------------------------------------------------------------------------
kernel=
prepare=
timeout=$DEFAULT_TIMEOUT
command=()
while (($#)); do
	case "$1" in
	--kernel) kernel=${2:?--kernel needs 6.1 or 5.10}; shift 2 ;;
	--kernel=*) kernel=${1#*=}; shift ;;
	--timeout) timeout=${2:?--timeout needs seconds}; shift 2 ;;
	--timeout=*) timeout=${1#*=}; shift ;;
	--prepare) prepare=1; shift ;;
	--) shift; command=("$@"); break ;;
	-h | --help) usage 0 ;;
	*) log "unknown argument $1"; usage 2 ;;
	esac
done
case "$kernel" in
6.1) suite=bookworm ;;
5.10) suite=bullseye ;;
sid) suite=sid ;;
'') log "--kernel is required"; usage 2 ;;
*) log "--kernel $kernel: 6.1 (bookworm), 5.10 (bullseye) or sid (unstable's newest)"; usage 2 ;;
esac
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout needs a whole number of seconds (not $timeout)"
[[ -n $prepare ]] || ((${#command[@]})) || { log "no COMMAND (after --)"; usage 2; }

need qemu-system-x86_64 qemu-system-x86
need busybox busybox-static
# virtme-ng looks for modprobe and depmod in PATH; Debian keeps them in /usr/sbin.
export PATH=$PATH:/usr/sbin:/sbin
need depmod kmod
need modprobe kmod
need flock util-linux
need timeout coreutils
command -v python3 >/dev/null || die "python3 not found (virtme-ng is a Python program): install python3 and python3-venv"
case "$(realpath -m "$cache_root")/" in
"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
esac

venv=$vm_root/venv-virtme-ng-$VIRTME_NG_VERSION
# (The venv links the python3 it was made with: it must still run.)
venv_ready() { [[ -e $venv/.complete && -x $venv/bin/vng ]] && "$venv/bin/python" -c "" 2>/dev/null; }
# The kernel's directory: the one of the suite that is complete (there is at most one).
kernel_dir() {
	local d
	for d in "$vm_root/$suite"-*; do
		[[ -e $d/.complete ]] && { echo "$d"; return 0; }
	done
	return 1
}
ready() { venv_ready && kernel_dir >/dev/null; }

# --- preparing the cache --------------------------------------------------------------------------
prepare_venv() {
	local t0
	t0=$(now_ms)
	rm -rf "$venv"
	python3 -m venv "$venv" || die "python3 -m venv failed (Debian: install python3-venv)"
	step "pip install virtme-ng==$VIRTME_NG_VERSION (PyPI)" \
		quietly "$venv/pip.log" "$venv/bin/pip" install --disable-pip-version-check --no-input --no-cache-dir "virtme-ng==$VIRTME_NG_VERSION" ||
		die "pip install virtme-ng failed: $(tail -5 "$venv/pip.log")"
	[[ -x $venv/bin/vng ]] || die "the virtme-ng package installed no vng"
	: >"$venv/.complete"
	log "virtme-ng $VIRTME_NG_VERSION in $venv: $(secs $(($(now_ms) - t0))) s"
}

prepare_kernel() {
	local t0 mirror apt_dir work package kver version deb m packages
	t0=$(now_ms)
	for tool in apt-get apt-cache dpkg dpkg-deb; do need "$tool" dpkg; done
	[[ -r $KEYRING ]] || die "$KEYRING missing (package debian-archive-keyring)"
	# shellcheck source=scripts/debian-mirror.sh
	source "$script_dir/debian-mirror.sh"
	# shellcheck source=scripts/cache-build.sh
	source "$script_dir/cache-build.sh"
	mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")
	apt_dir=$vm_root/apt-$suite
	private_apt "$apt_dir" "deb [signed-by=$KEYRING] $mirror $suite main"
	step "apt-get update ($mirror $suite, private lists)" quietly "$apt_dir/update.log" \
		apt-get "${apt_opts[@]}" --error-on=any update ||
		die "apt-get update failed for $mirror $suite: $(tail -5 "$apt_dir/update.log"); set KILOTUN_DEBIAN_MIRROR"
	# The package linux-image-amd64 points at: linux-image-<release>-amd64.
	package=$(apt-cache "${apt_opts[@]}" depends linux-image-amd64 |
		awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9].*-amd64$/ { print $2; exit }')
	[[ -n $package ]] || die "$mirror $suite: linux-image-amd64 depends on no linux-image-<release>-amd64"
	kver=${package#linux-image-}
	[[ $kernel == sid || $kver == "$kernel".* ]] || die "$suite's kernel is $kver, not $kernel"

	work=$(mktemp -d "$vm_root/.tmp.$suite.XXXXXX")
	# shellcheck disable=SC2064 # expand $work now.
	trap "rm -rf '$work'" EXIT
	# Newer suites split the kernel: linux-image-<release> then only depends on linux-binary-<release>
	# (the image), linux-modules-<release> and linux-base-<release> (modules.builtin); those come too.
	packages=("$package")
	for m in $(apt-cache "${apt_opts[@]}" depends "$package" |
		awk -v k="$kver" '$1 == "Depends:" && ($2 == "linux-binary-" k || $2 == "linux-modules-" k || $2 == "linux-base-" k) { print $2 }'); do
		packages+=("$m")
	done
	(cd "$work" && step "apt-get download ${packages[*]}" quietly "$work/download.log" apt-get "${apt_opts[@]}" download "${packages[@]}") ||
		die "cannot download ${packages[*]}: $(tail -5 "$work/download.log")"
	deb=$(echo "$work"/linux-image-*.deb)
	[[ -f $deb ]] || die "apt-get download left no .deb in $work"
	version=$(dpkg-deb -f "$deb" Version)
	for m in "$work"/*.deb; do
		step "dpkg -x $(basename "$m")" dpkg -x "$m" "$work/root" || die "dpkg -x $m failed"
	done
	# ... and keep the modules under usr/lib/modules, the image beside them: into the usual places.
	if [[ -d $work/root/usr/lib/modules/$kver && ! -e $work/root/lib/modules ]]; then
		mkdir -p "$work/root/lib" && mv "$work/root/usr/lib/modules" "$work/root/lib/modules"
	fi
	if [[ ! -e $work/root/boot/vmlinuz-$kver && -s $work/root/lib/modules/$kver/vmlinuz ]]; then
		mkdir -p "$work/root/boot" && mv "$work/root/lib/modules/$kver/vmlinuz" "$work/root/boot/vmlinuz-$kver"
	fi
	[[ -s $work/root/boot/vmlinuz-$kver && -d $work/root/lib/modules/$kver ]] ||
		die "$deb holds no boot/vmlinuz-$kver or lib/modules/$kver"
	for m in $PRUNE_MODULES; do rm -rf "${work:?}/root/lib/modules/$kver/$m"; done
	rm -rf "$work/root/usr/share"
	step "depmod -b (module index)" depmod -a -b "$work/root" "$kver" || die "depmod failed"
	for m in wireguard ipip veth tun 9p 9pnet_virtio virtio_pci overlay; do
		modprobe -d "$work/root" -S "$kver" --show-depends "$m" >/dev/null 2>&1 ||
			die "$package has no module $m (or depmod did not index it)"
	done
	echo "$package $version ($mirror $suite)" >"$work/root/VERSION"
	rm -f "$work"/*.deb "$work"/download.log
	: >"$work/root/.complete"
	chmod 755 "$work/root"
	# Under the exclusive lock: other kernels of the suite and leftovers go.
	for m in "$vm_root/$suite"-*; do
		[[ -e $m ]] || continue
		log "removing $m"
		rm -rf "$m"
	done
	mv -T "$work/root" "$vm_root/$suite-$kver"
	rm -rf "$work"
	trap - EXIT
	log "kernel $package $version in $vm_root/$suite-$kver ($(du -sm "$vm_root/$suite-$kver" | cut -f1) MB): $(secs $(($(now_ms) - t0))) s"
}

mkdir -p "$vm_root" 2>/dev/null || die "cannot create $vm_root (set KILOTUN_CACHE to a writable directory)"
[[ -e $vm_root/.lock ]] || : >>"$vm_root/.lock" || die "cannot create $vm_root/.lock"
exec 9<"$vm_root/.lock"
if ! ready; then
	if ! flock -n 9; then
		log "another caller holds $vm_root/.lock; waiting for it"
		flock 9
	fi
	rm -rf "$vm_root"/.tmp.*
	venv_ready || prepare_venv
	kernel_dir >/dev/null || prepare_kernel
fi
# Runs share the lock: nobody replaces the kernel under a running machine.
flock -s 9
kdir=$(kernel_dir) || die "no kernel for $suite in $vm_root"
kver=${kdir##*/"$suite"-}
log "kernel: $(cat "$kdir/VERSION" 2>/dev/null || echo "$kver"); virtme-ng $VIRTME_NG_VERSION"
[[ -z $prepare ]] || exit 0

# --- the run --------------------------------------------------------------------------------------
# The guest sees this machine's file system: the run's scripts live in a temporary directory here.
run_dir=$(mktemp -d "${TMPDIR:-/tmp}/kilotun-kernel-vm.XXXXXX")
chmod 755 "$run_dir"
vm_pid=
# shellcheck disable=SC2317 # called by the EXIT trap.
cleanup() {
	if [[ -n $vm_pid ]] && kill -0 "$vm_pid" 2>/dev/null; then
		kill "$vm_pid" 2>/dev/null || true
		wait "$vm_pid" 2>/dev/null || true
	fi
	rm -rf "$run_dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
nonce=$(od -An -tx1 -N8 /dev/urandom | tr -d ' \n')

{
	printf 'export KILOTUN_VM_KERNEL=%q\n' "$kver"
	[[ -z ${CI:-} ]] || printf 'export CI=%q\n' "$CI"
	printf 'cd %q\n' "$repo_root"
	printf 'exec'
	printf ' %q' "${command[@]}"
	echo
} >"$run_dir/run.sh"
# What virtme-ng's init runs (vng --exec): tun loaded, kernel messages off the console, the
# markers around COMMAND. COMMAND's output goes through a pipe (| cat), as it would on the host
# (the console is a terminal). vng powers the machine off when this returns.
cat >"$run_dir/init.sh" <<'EOF'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
dmesg -n 1 2>/dev/null
modprobe -q tun || echo "init: modprobe tun failed"
read -r up _ </proc/uptime
echo "KILOTUN_VM_BEGIN run=$1 uptime=$up kernel=$(uname -r) cpus=$(nproc)"
bash "$(dirname "$0")/run.sh" </dev/null 2>&1 | cat
rc=${PIPESTATUS[0]}
read -r up _ </proc/uptime
echo "KILOTUN_VM_EXIT=$rc run=$1 uptime=$up"
EOF
chmod 755 "$run_dir/init.sh" "$run_dir/run.sh"

# --verbose: the serial console comes to vng's stdout (otherwise it goes to /dev/null, and the
# script channel needs udev); loglevel=1 keeps the kernel's messages off it after the early boot.
# --rodir: the cache again, under its own path, over virtme-ng's tmpfs on /var/cache (the guest's
# /lib/modules/<release> links there). no_timer_check: under TCG on a busy host the emulated
# timer can tick too slowly for the kernel's early IO-APIC check, which then panics ("IO-APIC +
# timer doesn't work!") before anything runs.
vng=("$venv/bin/vng" --verbose --run "$kdir/boot/vmlinuz-$kver" --disable-kvm
	--cpus "$smp" --memory "$memory" --name kilotun-vm --force-9p --user root
	--rodir "$vm_root=$vm_root" --cwd "$run_dir"
	--append "loglevel=1 no_timer_check kilotun.run=$nonce"
	--exec "bash $run_dir/init.sh $nonce")

console_filter() {
	local line state=boot begin_pat exit_pat
	begin_pat="^KILOTUN_VM_BEGIN run=$nonce( (.*))?\$"
	exit_pat="^KILOTUN_VM_EXIT=([0-9]+) run=$nonce( (.*))?\$"
	while IFS= read -r line || [[ -n $line ]]; do
		line=${line//$'\r'/}
		printf '%s\n' "$line" >>"$run_dir/console.log"
		if [[ $line =~ $exit_pat ]]; then
			echo "${BASH_REMATCH[1]}" >"$run_dir/exit"
			log "command finished with exit status ${BASH_REMATCH[1]}${BASH_REMATCH[3]:+ (guest ${BASH_REMATCH[3]})}; powering off"
			state=after
		elif [[ $state == boot && $line =~ $begin_pat ]]; then
			log "guest booted, running: ${command[*]}${BASH_REMATCH[2]:+ (guest ${BASH_REMATCH[2]})}"
			state=running
		elif [[ $state == running ]]; then
			printf '%s\n' "$line"
		else
			printf 'guest| %s\n' "$line" >&2
		fi
	done
}

log "booting $kver: ${vng[*]}"
vm_t0=$(now_ms)
mkfifo "$run_dir/console"
console_filter <"$run_dir/console" &
filter_pid=$!
# PATH: vng runs virtme-run from its venv. timeout signals its whole process group, qemu too.
PATH=$venv/bin:$PATH timeout --kill-after=10 "$timeout" "${vng[@]}" </dev/null >"$run_dir/console" 2>&1 &
vm_pid=$!
vm_status=0
wait "$vm_pid" || vm_status=$?
vm_pid=
wait "$filter_pid" || true
log "machine stopped: $(secs $(($(now_ms) - vm_t0))) s from boot to power-off (vng exit status $vm_status)"
if [[ -s $run_dir/exit ]]; then
	exit "$(cat "$run_dir/exit")"
fi
if [[ $vm_status == 124 || $vm_status == 137 ]]; then
	log "error: timed out after $timeout s (--timeout); the console's last lines:"
	tail -n 40 "$run_dir/console.log" >&2 2>/dev/null || true
	exit 124
fi
log "error: the machine stopped without reporting an exit status; the console's last lines:"
tail -n 40 "$run_dir/console.log" >&2 2>/dev/null || true
exit 125
