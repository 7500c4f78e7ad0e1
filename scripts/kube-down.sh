#!/usr/bin/env bash
# Stop the control plane scripts/kube-up.sh started in DIR: kube-apiserver first, then etcd.
#
#   scripts/kube-down.sh DIR
#
# Each process gets SIGTERM, then SIGKILL if it is still there after 15 s; the script returns once
# both are gone. The pid files are removed; certificates, etcd data and logs stay in DIR (delete
# DIR to discard them). Stopping an already stopped DIR is not an error.
set -euo pipefail

log() { printf 'kube-down.sh: %s\n' "$*" >&2; }
(($# == 1)) || {
	log "usage: $0 DIR"
	exit 1
}
dir=$1
[[ -d $dir ]] || {
	log "error: $dir is not a directory"
	exit 1
}

# True while pid $1 exists and is not a zombie (a zombie has exited; only its parent can reap it,
# and that parent may not be us).
alive() {
	local state
	state=$(awk '{ sub(/.*\) /, ""); print $1 }' "/proc/$1/stat" 2>/dev/null) || return 1
	[[ -n $state && $state != Z ]]
}

rc=0
for name in kube-apiserver etcd; do
	pidfile="$dir/$name.pid"
	[[ -s $pidfile ]] || continue
	pid=$(cat "$pidfile")
	if ! [[ $pid =~ ^[0-9]+$ ]]; then
		log "ignoring $pidfile: not a pid"
		rm -f "$pidfile"
		continue
	fi
	# The pid may have been reused since kube-up.sh wrote it: only signal the process if it is
	# still the same program (comm is truncated to 15 characters: "kube-apiserver" fits).
	if alive "$pid" && [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]]; then
		kill -TERM "$pid" 2>/dev/null || true
		for ((i = 0; i < 150; i++)); do
			alive "$pid" || break
			sleep 0.1
		done
		if alive "$pid"; then
			log "$name (pid $pid) ignored SIGTERM for 15s; sending SIGKILL"
			kill -KILL "$pid" 2>/dev/null || true
			for ((i = 0; i < 50; i++)); do
				alive "$pid" || break
				sleep 0.1
			done
		fi
		if alive "$pid"; then
			log "error: $name (pid $pid) is still running"
			rc=1
			continue
		fi
		log "stopped $name (pid $pid)"
	fi
	rm -f "$pidfile"
done
exit "$rc"
