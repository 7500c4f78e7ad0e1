# shellcheck shell=bash
# Logging with timings, shared by the machine scripts (scripts/arm64-vm.sh, scripts/kernel-vm.sh;
# sourced, not run). Every line goes to stderr, prefixed with the script's name and the time since
# it started: `arm64-vm.sh: [   12.3 s] ...`.
#   now_ms                    milliseconds since the epoch
#   secs MILLISECONDS         "12.3"
#   log TEXT...  die TEXT...  a timed line; die exits 1 after it
#   usage [STATUS]            the calling script's header comment, then exit STATUS (0)
#   step DESCRIPTION CMD...   runs CMD and logs how long it took (and its failure)
#   quietly LOG CMD...        runs CMD with its stdout and stderr in the file LOG
#   need COMMAND PACKAGE      one message naming the Debian package when a tool is missing

now_ms() {
	local us=${EPOCHREALTIME//[.,]/}
	echo $((us / 1000))
}
secs() { printf '%d.%d' $(($1 / 1000)) $(($1 % 1000 / 100)); }
timed_log_start_ms=$(now_ms)
timed_log_name=${0##*/}
log() { printf '%s: [%7s s] %s\n' "$timed_log_name" "$(secs $(($(now_ms) - timed_log_start_ms)))" "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}
usage() {
	sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
	exit "${1:-0}"
}
step() {
	local what=$1 t0 rc=0
	shift
	t0=$(now_ms)
	"$@" || rc=$?
	log "$what: $(secs $(($(now_ms) - t0))) s$( ((rc == 0)) || echo ", failed (exit status $rc)")"
	return "$rc"
}
# shellcheck disable=SC2317 # called through step.
quietly() {
	local out=$1
	shift
	"$@" >"$out" 2>&1
}
need() { command -v "$1" >/dev/null || die "$1 not found: install the Debian package $2 (apt-get install $2)"; }
