# shellcheck shell=bash
# Sourced by the scripts that build root trees as root (scripts/arm64-vm.sh, scripts/cross-build.sh).
#
# mmdebstrap --mode=root mounts /proc, /sys and /dev into the tree it builds while the guest's
# maintainer scripts run. In the host's mount namespace those mounts are shared: a mount another
# process makes meanwhile (the network-namespace tests mount sysfs and /run/netns all the time)
# propagates into the tree, mmdebstrap's unmount then fails with EBUSY, and a later `rm -rf` of
# the tree walks into the host's /sys. Two rules keep that from happening:
#
#   in_private_mounts CMD...  runs CMD in a mount namespace of its own with private propagation:
#                             nothing it mounts is seen outside or outlives it, and nothing mounted
#                             outside reaches it.
#   remove_tree PATH...       detaches whatever is still mounted at or below each PATH (deepest
#                             first), then removes it without crossing into another file system.

in_private_mounts() {
	unshare --mount --propagation private -- "$@"
}

remove_tree() {
	local path target
	for path in "$@"; do
		[[ -e $path ]] || continue
		path=$(realpath -- "$path")
		# /proc/self/mountinfo's fifth field is the mount point (spaces escaped as \040: the
		# trees these scripts make have none).
		while read -r target; do
			umount --lazy -- "$target" 2>/dev/null || true
		done < <(awk -v p="$path" '$5 == p || index($5, p "/") == 1 { print $5 }' /proc/self/mountinfo | sort -r)
		rm -rf --one-file-system -- "$path"
	done
}
