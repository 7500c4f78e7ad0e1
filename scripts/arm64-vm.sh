#!/usr/bin/env bash
# Run the README demo (tests/demo.sh), or any command, with ARM kg and kgctl inside an emulated
# Debian bookworm machine of that architecture (a real ARM kernel, full-system TCG emulation):
# arm64 (the default) or armv7 (32-bit, armhf):
#
#   scripts/arm64-vm.sh [--arch A] --kg PATH --kgctl PATH [--timeout SECS] [-- COMMAND...]
#   scripts/arm64-vm.sh [--arch A] --prepare   # only build the cached kernel, initrd, root image
#
# --arch A is arm64 (the default) or armv7.
#
# Why a whole machine: qemu-user cannot run kg (its netlink translation refuses RTM_GETRULE dumps
# and NETLINK_NETFILTER sockets), so kg's end-to-end on ARM needs an ARM kernel. The binaries
# come from `scripts/cross-build.sh --target arm64|armv7 --profile ci-arm` (target/aarch64-unknown-
# linux-gnu/ci-arm/{kg,kgctl}, target/armv7-unknown-linux-gnueabihf/ci-arm/{kg,kgctl}); --kg and --kgctl
# must be ELF files of --arch's machine (aarch64, or 32-bit ARM).
#
#   --arch  qemu                                                  Debian (mmdebstrap, kernel)
#   arm64   qemu-system-aarch64 -M virt -cpu max,pauth-impdef=on  arm64, linux-image-arm64
#   armv7   qemu-system-arm -M virt,highmem=off -cpu cortex-a15   armhf, linux-image-armmp-lpae
#
# The guest runs with `-accel tcg -smp 2 -m 2048` (KILOTUN_VM_CPU, KILOTUN_VM_SMP,
# KILOTUN_VM_MEMORY override -cpu, -smp and -m), booted directly (-kernel/-initrd, no firmware)
# from that Debian bookworm kernel, with an ext4 root file system made by `mmdebstrap
# --architectures=arm64|armhf` (qemu-user-static runs the maintainer scripts) holding what the
# demo uses: iproute2, iputils-ping, wireguard-tools, iptables, nftables, procps, kmod. Kernel,
# initrd and root image are built once per architecture (a few minutes) and cached in
# ${KILOTUN_CACHE:-/var/cache/kilotun}/<arch>-vm/bookworm-<recipe hash>/ (arm64-vm, armv7-vm;
# outside the repository; created in a temporary directory and renamed; a flock on
# <arch>-vm/.lock makes creation exclusive and runs share it). Delete that directory to rebuild; a
# changed recipe (package list, baked init, initramfs settings) gets a new hash and replaces the
# old directory. The Debian mirror is the one this machine's apt uses for bookworm
# (KILOTUN_DEBIAN_MIRROR overrides it; scripts/debian-mirror.sh); the machine's apt configuration
# is not touched.
#
# Per run: the root image is never written (a qcow2 copy-on-write overlay in a temporary
# directory takes the guest's writes), and a second small ext4 disk (label kilotun-run, mounted at
# /mnt/kilotun in the guest) carries kg, kgctl, tests/demo.sh (as /mnt/kilotun/tests/demo.sh, so
# the demo's "repository root" is /mnt/kilotun), the guest's init script and the command. The
# guest runs COMMAND as root in /mnt/kilotun with DEMO_KG=/mnt/kilotun/kg and
# DEMO_KGCTL=/mnt/kilotun/kgctl in its environment, stdin from /dev/null; its output (stdout and
# stderr merged: both go to the serial console) is printed on this script's stdout as it comes;
# then the guest powers off and this script exits with COMMAND's exit status, passed back on the
# console as a marker line `KILOTUN_VM_EXIT=<n> run=<nonce>`. The default COMMAND is
# `bash /mnt/kilotun/tests/demo.sh`. Examples:
#
#   scripts/arm64-vm.sh --kg target/aarch64-unknown-linux-gnu/ci-arm/kg \
#       --kgctl target/aarch64-unknown-linux-gnu/ci-arm/kgctl
#   scripts/arm64-vm.sh --arch armv7 --kg target/armv7-unknown-linux-gnueabihf/ci-arm/kg \
#       --kgctl target/armv7-unknown-linux-gnueabihf/ci-arm/kgctl
#   scripts/arm64-vm.sh --kg ... --kgctl ... -- env DEMO_HOLD=5 bash tests/demo.sh
#   scripts/arm64-vm.sh --kg ... --kgctl ... -- sh -c 'uname -a; ./kg --version'
#
# Everything else (progress with timings, the guest's boot console) goes to stderr. Exit status:
# COMMAND's; 124 when --timeout SECS (default 900, boot to power-off) passes first; 125 when the
# machine stops without reporting one (the console's tail is printed); 1 for errors here, 2 for
# bad arguments.
#
# Needs: qemu-system-arm (qemu-system-aarch64 and qemu-system-arm), qemu-utils (qemu-img),
# e2fsprogs (mkfs.ext4 -d), util-linux, coreutils; to build the cache also root, mmdebstrap,
# arch-test and qemu-user-static registered with binfmt_misc (qemu-aarch64, qemu-arm). Running
# the machine needs no root, only read access to the cache. On a busy 2-core machine an image
# takes 3 to 7 minutes to build (armv7's: 201 s, at a load of 3 to 5), far longer when cargo
# builds starve it, and a demo run about a minute on either architecture (12 to 18 s to boot, 39
# to 47 s of demo, power-off under a second); see the timings on stderr.
set -euo pipefail

# What goes into the root file system: the architecture's kernel (kernel_package, below) and
# these. The kernel and initramfs-tools make it bootable; the rest is what the guest's init,
# tests/demo.sh and kg run (mount, which is not Essential; ip, ping, wg, sysctl,
# iptables/ip6tables with their -legacy and -nft variants, nft, modprobe).
readonly SUITE=bookworm
readonly COMMON_PACKAGES=initramfs-tools,mount,iproute2,iputils-ping,wireguard-tools,iptables,nftables,procps,kmod
# Kernel module directories dropped from the image after the initramfs is made: hardware a virt
# machine has none of. depmod runs again afterwards.
readonly PRUNE_MODULES="kernel/drivers/gpu kernel/drivers/media kernel/drivers/net/wireless kernel/drivers/staging kernel/drivers/infiniband kernel/drivers/iio kernel/drivers/bluetooth kernel/sound kernel/net/wireless kernel/net/mac80211 kernel/net/bluetooth"
readonly DEFAULT_TIMEOUT=900

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}

# --- logging with timings -------------------------------------------------------------------------
# Milliseconds since the epoch ($EPOCHREALTIME without its decimal separator is microseconds).
# now_ms, secs, log, die, usage, step, quietly, need.
# shellcheck source=scripts/timed-log.sh
source "$(dirname "${BASH_SOURCE[0]}")/timed-log.sh"
# shellcheck source=scripts/private-mounts.sh
source "$(dirname "${BASH_SOURCE[0]}")/private-mounts.sh"

# --- arguments ------------------------------------------------------------------------------------
arch=arm64
kg=
kgctl=
prepare=
timeout=$DEFAULT_TIMEOUT
command=()
while (($#)); do
	case "$1" in
	--kg) kg=${2:?--kg needs a path}; shift 2 ;;
	--kg=*) kg=${1#*=}; shift ;;
	--kgctl) kgctl=${2:?--kgctl needs a path}; shift 2 ;;
	--kgctl=*) kgctl=${1#*=}; shift ;;
	--timeout) timeout=${2:?--timeout needs seconds}; shift 2 ;;
	--timeout=*) timeout=${1#*=}; shift ;;
	--arch) arch=${2:?--arch needs arm64 or armv7}; shift 2 ;;
	--arch=*) arch=${1#*=}; shift ;;
	--prepare) prepare=1; shift ;;
	--) shift; command=("$@"); break ;;
	-h | --help) usage 0 ;;
	*) log "unknown argument $1"; usage 2 ;;
	esac
done
[[ -n $prepare || (-n $kg && -n $kgctl) ]] || { log "--kg and --kgctl are required"; usage 2; }
[[ $timeout =~ ^[1-9][0-9]*$ ]] || die "--timeout needs a whole number of seconds (not $timeout)"
((${#command[@]})) || command=(bash /mnt/kilotun/tests/demo.sh)

# What differs between the two machines. deb_arch: Debian's name (mmdebstrap --architectures);
# kernel_package: Debian's kernel for qemu's virt machine (armmp-lpae: the armv7 multiplatform
# kernel with LPAE, for a Cortex-A15); elf_machine: e_machine of the binaries (EM_AARCH64 183,
# EM_ARM 40); qemu_user: qemu-user-static's binfmt_misc entry (and qemu-<it>-static); machine and
# default_cpu: qemu-system's -M and -cpu (32-bit ARM without highmem: the virt machine's PCIe
# windows then stay below 4 GiB).
case "$arch" in
arm64)
	deb_arch=arm64 kernel_package=linux-image-arm64 triple=aarch64-unknown-linux-gnu elf_machine=183
	qemu_user=qemu-aarch64 qemu_system=qemu-system-aarch64 machine=virt default_cpu=max,pauth-impdef=on
	;;
armv7)
	deb_arch=armhf kernel_package=linux-image-armmp-lpae triple=armv7-unknown-linux-gnueabihf elf_machine=40
	qemu_user=qemu-arm qemu_system=qemu-system-arm machine=virt,highmem=off default_cpu=cortex-a15
	;;
*) log "--arch is arm64 or armv7 (not $arch)"; usage 2 ;;
esac
readonly PACKAGES=$kernel_package,$COMMON_PACKAGES
vm_root=$cache_root/$arch-vm
cpu=${KILOTUN_VM_CPU:-$default_cpu}
smp=${KILOTUN_VM_SMP:-2}
memory=${KILOTUN_VM_MEMORY:-2048}

# is_target_elf FILE: an ELF file whose e_machine (2 bytes at offset 18) is $elf_machine.
is_target_elf() {
	[[ $(head -c 4 "$1" | od -An -c | tr -d ' ') == 177ELF ]] &&
		[[ $(od -An -tu2 -j18 -N2 "$1" | tr -d ' ') == "$elf_machine" ]]
}
if [[ -z $prepare ]]; then
	for f in "$kg" "$kgctl"; do
		[[ -f $f && -r $f ]] || die "$f is not a readable file"
		is_target_elf "$f" || die "$f is not an $arch ($triple) ELF binary; build them with scripts/cross-build.sh --target $arch --profile ci"
	done
fi
[[ -r $repo_root/tests/demo.sh ]] || die "$repo_root/tests/demo.sh is missing"

need "$qemu_system" qemu-system-arm
need qemu-img qemu-utils
need mkfs.ext4 e2fsprogs
need flock util-linux
need timeout coreutils
need sha256sum coreutils
case "$(realpath -m "$cache_root")/" in
"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
esac

# --- the guest's baked-in init --------------------------------------------------------------------
# The image boots with init=/sbin/kilotun-init instead of an init system: no systemd, no services,
# so the guest is up a few seconds after the kernel mounts its root (under TCG every second of
# boot counts). This stub only mounts the per-run disk and hands over to its init.sh (below), so
# changing what a run does needs no new image. Without that disk it reports exit 125 and powers
# off. The run's nonce comes from the kernel command line (kilotun.run=...).
read -r -d '' BAKED_INIT <<'EOF' || true
#!/bin/sh
# PID 1 of the kilotun @ARCH@ test machine (scripts/arm64-vm.sh): mount the per-run disk and run
# its init.sh.
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
[ -e /proc/self ] || mount -t proc proc /proc
[ -e /sys/kernel ] || mount -t sysfs sysfs /sys
[ -e /dev/null ] || mount -t devtmpfs devtmpfs /dev
mkdir -p /mnt/kilotun
if mount -t ext4 LABEL=kilotun-run /mnt/kilotun && [ -r /mnt/kilotun/init.sh ]; then
	exec /bin/bash /mnt/kilotun/init.sh
fi
nonce=$(sed -n 's/.*kilotun\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
echo "kilotun-init: no per-run disk (ext4, label kilotun-run) with init.sh"
echo "KILOTUN_VM_EXIT=125 run=$nonce"
echo o >/proc/sysrq-trigger
while :; do sleep 60; done
EOF
# (arm64's text, and so its recipe hash and cached image, are what they were before --arch.)
BAKED_INIT=${BAKED_INIT//@ARCH@/$arch}
# initramfs-tools settings, in place before the kernel's postinst makes the initrd: only the
# modules needed to find and mount the root disk (a small initrd unpacks fast), gzip (zstd is only
# recommended, not installed), and no resume device (mkinitramfs would otherwise look at the
# build machine's swap, and the boot would wait for it).
read -r -d '' INITRAMFS_CONF <<'EOF' || true
MODULES=list
COMPRESS=gzip
RESUME=none
EOF
read -r -d '' INITRAMFS_MODULES <<'EOF' || true
virtio_pci
virtio_blk
ext4
EOF
# The cache directory's name changes whenever what goes into the image does.
recipe_hash=$(printf '%s\n' "$SUITE" "$PACKAGES" "$PRUNE_MODULES" "$BAKED_INIT" "$INITRAMFS_CONF" "$INITRAMFS_MODULES" | sha256sum | cut -c1-12)
image_dir=$vm_root/$SUITE-$recipe_hash

image_ready() { [[ -s $image_dir/vmlinuz && -s $image_dir/initrd.img && -s $image_dir/rootfs.img ]]; }

# --- building the cached kernel, initrd and root image ------------------------------------------
build_image() {
	local work root kver m used size
	[[ $(id -u) == 0 ]] || die "building the image in $image_dir needs root (mmdebstrap --mode=root); later runs do not"
	need mmdebstrap mmdebstrap
	need arch-test arch-test
	need "$qemu_user-static" qemu-user-static
	# mmdebstrap runs the guest's maintainer scripts through binfmt_misc and qemu-user-static.
	if [[ ! -e /proc/sys/fs/binfmt_misc/status ]]; then
		mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || die "binfmt_misc is not mounted and could not be"
	fi
	[[ -e /proc/sys/fs/binfmt_misc/$qemu_user ]] ||
		die "no binfmt_misc entry $qemu_user: install qemu-user-static (it registers it) or run update-binfmts --enable $qemu_user"
	# shellcheck source=scripts/debian-mirror.sh
	source "$script_dir/debian-mirror.sh"
	local mirror
	mirror=$(require_mirror "${KILOTUN_DEBIAN_MIRROR:-}")

	# Under the exclusive lock nobody else builds or runs: leftovers of interrupted builds and
	# images of older recipes can go.
	remove_tree "$vm_root"/.tmp.*
	for m in "$vm_root/$SUITE"-*; do
		[[ -e $m && $m != "$image_dir" ]] || continue
		log "removing the image of an older recipe, $m"
		remove_tree "$m"
	done

	work=$(mktemp -d "$vm_root/.tmp.XXXXXX")
	# shellcheck disable=SC2064 # expand $work now.
	trap "remove_tree '$work'" EXIT
	root=$work/root
	mkdir -p "$work/pre/etc/initramfs-tools/conf.d"
	printf '%s\n' "$INITRAMFS_CONF" >"$work/pre/etc/initramfs-tools/conf.d/kilotun"
	printf '%s\n' "$INITRAMFS_MODULES" >"$work/pre/etc/initramfs-tools/modules"

	log "building the $arch image in $image_dir (mmdebstrap $SUITE $mirror, packages $PACKAGES)"
	# --variant=essential: Essential packages plus --include (no apt inside: the guest installs
	# nothing). No Recommends (firmware, apparmor, ...), no documentation or translations. The
	# essential hook puts the initramfs settings in place before the kernel is installed.
	if ! step "mmdebstrap ($deb_arch $SUITE, maintainer scripts under qemu-user)" \
		quietly "$work/mmdebstrap.log" in_private_mounts mmdebstrap --mode=root --variant=essential --architectures="$deb_arch" \
		--aptopt='Acquire::Check-Valid-Until "false"' --aptopt='Acquire::Languages "none"' \
		--aptopt='APT::Install-Recommends "false"' \
		--dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
		--dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
		--essential-hook="cp -a $(printf %q "$work/pre")/. \"\$1/\"" \
		--include="$PACKAGES" "$SUITE" "$root" "$mirror"; then
		tail -30 "$work/mmdebstrap.log" >&2
		die "mmdebstrap failed (above); the mirror is $mirror (KILOTUN_DEBIAN_MIRROR overrides it)"
	fi

	# The kernel and initrd boot the machine directly (-kernel, -initrd): out of the image.
	kver=$(basename "$(find "$root/usr/lib/modules" -mindepth 1 -maxdepth 1 -type d | head -n1)")
	if [[ -z $kver || ! -s $root/boot/vmlinuz-$kver || ! -s $root/boot/initrd.img-$kver ]]; then
		tail -30 "$work/mmdebstrap.log" >&2
		die "the image has no kernel or initrd in /boot ($kernel_package's postinst failed? mmdebstrap's log above)"
	fi
	cp "$root/boot/vmlinuz-$kver" "$work/vmlinuz"
	cp "$root/boot/initrd.img-$kver" "$work/initrd.img"
	rm -f "$root/boot/vmlinuz-$kver" "$root/boot/initrd.img-$kver" "$root/boot/System.map-$kver" "$root/vmlinuz"* "$root/initrd.img"*

	# Hardware modules a virt machine cannot use, then the module index again (the image's own
	# depmod, through qemu-user).
	for m in $PRUNE_MODULES; do rm -rf "${root:?}/usr/lib/modules/$kver/$m"; done
	step "depmod after pruning" chroot "$root" /usr/sbin/depmod "$kver"

	# The baked init, a hostname, an empty fstab (init mounts what it needs).
	printf '%s\n' "$BAKED_INIT" >"$root/sbin/kilotun-init"
	chmod 755 "$root/sbin/kilotun-init"
	echo "kilotun-$arch" >"$root/etc/hostname"
	: >"$root/etc/fstab"
	rm -rf "${root:?}"/var/cache/apt/* "${root:?}"/var/lib/apt/lists/* "${root:?}"/var/log/*
	dpkg-query --admindir="$root/var/lib/dpkg" -W -f '${Package} ${Version}\n' >"$work/packages"
	echo "$kver" >"$work/kernel-version"

	# An ext4 image straight from the directory (mkfs.ext4 -d: no loop device, no mount), the
	# size of the contents plus a fifth and 256 MiB for the guest's own writes. No journal: every
	# run writes to a throw-away overlay.
	used=$(du -sm "$root" | cut -f1)
	size=$((used + used / 5 + 256))
	step "mkfs.ext4 -d (${used} MiB of files, ${size} MiB image)" \
		quietly "$work/mkfs.log" mkfs.ext4 -q -F -t ext4 -O ^has_journal -L kilotun-root -d "$root" "$work/rootfs.img" "${size}M" ||
		die "mkfs.ext4 failed: $(cat "$work/mkfs.log")"
	step "removing the build tree" remove_tree "$root" "$work/pre" "$work/mkfs.log"
	mv "$work/mmdebstrap.log" "$work/build.log"
	chmod 755 "$work" # mktemp's 0700 would keep runs by other users out.
	mv -T "$work" "$image_dir"
	trap - EXIT
	log "image ready: kernel $kver, root $(du -h --apparent-size "$image_dir/rootfs.img" | cut -f1) ($(du -h "$image_dir/rootfs.img" | cut -f1) on disk), initrd $(du -h "$image_dir/initrd.img" | cut -f1), $(wc -l <"$image_dir/packages") packages"
}

mkdir -p "$vm_root" 2>/dev/null || die "cannot create $vm_root (set KILOTUN_CACHE to a writable directory)"
# The lock is taken on a read-only descriptor: a run needs no write access to the cache.
[[ -e $vm_root/.lock ]] || : >>"$vm_root/.lock" || die "cannot create $vm_root/.lock"
exec 9<"$vm_root/.lock"
if ! image_ready; then
	if ! flock -n 9; then
		log "another caller holds $vm_root/.lock; waiting for it"
		flock 9
	fi
	if image_ready; then
		log "another caller built $image_dir meanwhile"
	else
		build_t0=$(now_ms)
		build_image
		log "image built in $(secs $(($(now_ms) - build_t0))) s"
	fi
fi
# Runs share the lock: nobody replaces the image under a running machine.
flock -s 9
log "image: $image_dir (kernel $(cat "$image_dir/kernel-version" 2>/dev/null || echo '?'))"
[[ -z $prepare ]] || exit 0

# --- the per-run disk and overlay -----------------------------------------------------------------
run_dir=$(mktemp -d "${TMPDIR:-/tmp}/kilotun-$arch-vm.XXXXXX")
qemu_pid_file=$run_dir/qemu.pid
# shellcheck disable=SC2317 # called by the EXIT trap.
cleanup() {
	# qemu writes its pid file; stop it if this script is interrupted while it runs.
	if [[ -s $qemu_pid_file ]] && kill -0 "$(cat "$qemu_pid_file")" 2>/dev/null; then
		kill "$(cat "$qemu_pid_file")" 2>/dev/null || true
	fi
	# ... and let the console's reader finish before its directory goes.
	if [[ -n ${pipeline_pid:-} ]]; then wait "$pipeline_pid" 2>/dev/null || true; fi
	rm -rf "$run_dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
nonce=$(od -An -tx1 -N8 /dev/urandom | tr -d ' \n')

stage=$run_dir/stage
mkdir -p "$stage/tests"
cp "$kg" "$stage/kg"
cp "$kgctl" "$stage/kgctl"
chmod 755 "$stage/kg" "$stage/kgctl"
cp "$repo_root/tests/demo.sh" "$stage/tests/demo.sh"
# The command, quoted word by word.
{
	echo 'export DEMO_KG=/mnt/kilotun/kg DEMO_KGCTL=/mnt/kilotun/kgctl'
	echo 'cd /mnt/kilotun'
	printf 'exec'
	printf ' %q' "${command[@]}"
	echo
} >"$stage/run.sh"
# The guest's PID 1 after the baked stub: the usual virtual file systems (the initramfs moved
# /proc, /sys, /dev and /run over already), tun loaded (without udev or systemd-tmpfiles nothing
# creates /dev/net/tun until the module is in; veth, bridge, nf_tables load on demand), kernel
# messages off the console, then the markers around COMMAND and a power-off. COMMAND's output
# goes through a pipe (| cat), as it would on the host: the console is a terminal, and programs
# would colour their output for it (wg show does). (sysrq o: PSCI
# SYSTEM_OFF, qemu exits). PID 1 must never exit (the kernel would panic), hence the loop.
cat >"$stage/init.sh" <<'EOF'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
nonce=$(sed -n 's/.*kilotun\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
mountpoint -q /run || mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run
mkdir -p /dev/pts /dev/shm /run/lock
mountpoint -q /dev/pts || mount -t devpts -o gid=5,mode=620 devpts /dev/pts
mountpoint -q /dev/shm || mount -t tmpfs -o nosuid,nodev tmpfs /dev/shm
mountpoint -q /tmp || mount -t tmpfs -o nosuid,nodev tmpfs /tmp
dmesg -n 1
hostname kilotun-@ARCH@
ip link set lo up
modprobe -q tun || echo "init: modprobe tun failed"
read -r up _ </proc/uptime
echo "KILOTUN_VM_BEGIN run=$nonce uptime=$up kernel=$(uname -r) cpus=$(nproc)"
bash /mnt/kilotun/run.sh </dev/null 2>&1 | cat
rc=${PIPESTATUS[0]}
read -r up _ </proc/uptime
sync
echo "KILOTUN_VM_EXIT=$rc run=$nonce uptime=$up"
echo o >/proc/sysrq-trigger
while :; do sleep 60; done
EOF
sed -i "s/@ARCH@/$arch/" "$stage/init.sh"
chmod 755 "$stage/init.sh" "$stage/run.sh"
run_mb=$(($(du -sm "$stage" | cut -f1) + 32))
step "per-run disk (${run_mb} MiB: kg, kgctl, tests/demo.sh, init.sh, run.sh)" \
	quietly "$run_dir/mkfs.log" mkfs.ext4 -q -F -t ext4 -O ^has_journal -L kilotun-run -d "$stage" "$run_dir/run.img" "${run_mb}M" ||
	die "mkfs.ext4 failed: $(cat "$run_dir/mkfs.log")"
step "copy-on-write overlay over the root image" \
	qemu-img create -q -f qcow2 -b "$image_dir/rootfs.img" -F raw "$run_dir/root.qcow2"

# --- the machine ----------------------------------------------------------------------------------
# -nodefaults: no NIC (the demo's networks are namespaces inside the guest), no VGA, no monitor;
# the PL011 UART is the console (ttyAMA0) and qemu's stdout. arm64: pauth-impdef=on keeps -cpu
# max's pointer authentication but with QEMU's cheap hash instead of QARMA5, which costs TCG
# dearly. armv7: a Cortex-A15 has LPAE, which the armmp-lpae kernel needs; highmem=off keeps the
# PCIe windows below 4 GiB (2 GiB of RAM fits there). Both power off through PSCI (sysrq o).
# cache=unsafe: nothing written in a run is kept. virtio-rng: entropy for keys from the start.
# panic=-1 with -no-reboot: a guest panic ends qemu at once (then no marker: exit 125).
cmdline="console=ttyAMA0 root=/dev/vda rw rootfstype=ext4 init=/sbin/kilotun-init quiet loglevel=3 fsck.mode=skip noresume panic=-1 kilotun.run=$nonce"
# shellcheck disable=SC2054 # the commas are qemu's option syntax.
qemu=("$qemu_system" -M "$machine" -accel tcg,thread=multi -cpu "$cpu" -smp "$smp" -m "$memory"
	-nodefaults -no-user-config -display none -monitor none -serial stdio -no-reboot
	-kernel "$image_dir/vmlinuz" -initrd "$image_dir/initrd.img" -append "$cmdline"
	-drive "if=none,id=root,file=$run_dir/root.qcow2,format=qcow2,cache=unsafe"
	-device virtio-blk-pci,drive=root
	-drive "if=none,id=run,file=$run_dir/run.img,format=raw,cache=unsafe"
	-device virtio-blk-pci,drive=run
	-device virtio-rng-pci
	-pidfile "$qemu_pid_file")

# console_filter: reads the serial console. Lines between the BEGIN and EXIT markers of this run
# are COMMAND's output: stdout. Everything else (the boot, the power-off) goes to stderr as
# "guest| ..." lines. All of it lands in console.log; the markers' arrival is logged with timings
# and the exit status written to $run_dir/exit.
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

log "booting: ${qemu[*]}"
qemu_t0=$(now_ms)
# In the background and waited for, so that a signal to this script runs its trap at once (which
# stops qemu through its pid file) instead of after the machine's power-off.
{
	qemu_status=0
	timeout --kill-after=10 "$timeout" "${qemu[@]}" </dev/null 2>"$run_dir/qemu.err" || qemu_status=$?
	echo "$qemu_status" >"$run_dir/qemu.status"
} | console_filter &
pipeline_pid=$!
wait "$pipeline_pid" || true
pipeline_pid=
qemu_status=$(cat "$run_dir/qemu.status" 2>/dev/null || echo '?')
log "machine stopped: $(secs $(($(now_ms) - qemu_t0))) s from boot to power-off (qemu exit status $qemu_status)"
if [[ -s $run_dir/qemu.err ]]; then
	sed 's/^/qemu| /' "$run_dir/qemu.err" >&2
fi
if [[ -s $run_dir/exit ]]; then
	exit "$(cat "$run_dir/exit")"
fi
if [[ $qemu_status == 124 || $qemu_status == 137 ]]; then
	log "error: timed out after $timeout s (--timeout); the console's last lines:"
	tail -n 40 "$run_dir/console.log" >&2 2>/dev/null || true
	exit 124
fi
log "error: the machine stopped without reporting an exit status; the console's last lines:"
tail -n 40 "$run_dir/console.log" >&2 2>/dev/null || true
exit 125
