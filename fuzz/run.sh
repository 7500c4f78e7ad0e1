#!/usr/bin/env bash
# Runs the libFuzzer targets of fuzz/fuzz_targets/, each for a fixed time:
#
#   fuzz/run.sh [--seconds N] [TARGET...]        # default: an hour each, every target, in turn
#   fuzz/run.sh --ci [--seconds N] [TARGET...]   # what .ci/run does (20 s each)
#   fuzz/run.sh --prepare                        # only build the targets
#
# TARGET is one of the targets of fuzz/Cargo.toml (default: all seven). Each target starts from
# its committed corpus, fuzz/corpus/TARGET/, which `cargo test` replays (control/src/fuzzing.rs,
# dataplane/src/fuzzing.rs, src/model/). libFuzzer writes the inputs that reach new coverage into
# a scratch directory, never into the repository while it runs. At the end of a target's run:
#   without --ci  the new inputs that still add coverage are merged into fuzz/corpus/TARGET/
#                 (libFuzzer's -merge=1: only those that add features to what the corpus has;
#                 for agents, only those that reach new edges, -use_counters=0),
#                 and a crashing input is copied there too (crash-<sha1>), so `cargo test` keeps
#                 replaying it once it is fixed;
#   with --ci     the new inputs are dropped (the clone is throwaway), and a crashing input is
#                 left in the scratch directory (printed, with the command that replays it).
# With --ci the agents target starts from an empty corpus instead: one of its inputs is a whole
# cluster run to convergence, and replaying its corpus takes longer than CI's 20 s. A target whose
# corpus takes longer than the time to replay is interrupted 10 s after it (libFuzzer's SIGINT).
# Any crash, timeout (an input running over 60 s) or out-of-memory (4 GiB) fails the run (exit 1),
# after the other targets have had their time; inputs slower than 10 s are listed, not failures.
# Each target's figures are printed on one line (executions, libFuzzer's final cov: and ft:, new
# inputs, crash), and its whole log kept in the scratch directory (KILOTUN_FUZZ_WORK, default a
# new /tmp/kilotun-fuzz.XXXXXX).
#
# The build: no cargo-fuzz. One `cargo build --profile ci` of fuzz/Cargo.toml with
# fuzz/instrument-rustc.sh as RUSTC_WRAPPER, in the workspace's own target directory: the code
# under test (dataplane, control, kilotun, the patched boringtun and the targets) gets the
# instrumentation and flags cargo-fuzz 0.13 passes (SanitizerCoverage, --cfg fuzzing, debug
# assertions and overflow checks; no AddressSanitizer: its checks are for the memory errors of
# unsafe code, of which the fuzzed paths have little), every other crate is compiled as the test
# build (`cargo nextest run --cargo-profile ci`) compiles it, and cargo reuses those artifacts.
# After a test build that is about 230 CPU s (docs/testing.md, "Fuzzing"); from nothing, the test
# build's dependencies are built first. The binaries land in TARGET_DIR/ci/ (KILOTUN_FUZZ_TARGET_DIR,
# by default ${CARGO_TARGET_DIR:-target}); the build holds the target directory's lock while it runs.
set -euo pipefail

fuzz_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo_root=$(cd "$fuzz_dir/.." && pwd -P)
target_dir=${KILOTUN_FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:-$repo_root/target}}

log() { printf 'fuzz/run.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

seconds=3600
ci=false
prepare_only=false
targets=()
while (($#)); do
	case $1 in
	--seconds)
		[[ ${2:-} =~ ^[1-9][0-9]*$ ]] || die "--seconds needs a positive number of seconds"
		seconds=$2
		shift
		;;
	--ci) ci=true ;;
	--prepare) prepare_only=true ;;
	-*) die "unknown option '$1' (usage: $0 [--ci] [--prepare] [--seconds N] [TARGET...])" ;;
	*) targets+=("$1") ;;
	esac
	shift
done

all_targets=()
while read -r name; do all_targets+=("$name"); done < <(sed -n 's/^name = "\(.*\)"$/\1/p' "$fuzz_dir/Cargo.toml" | grep -vx kilotun-fuzz)
((${#targets[@]})) || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
	[[ " ${all_targets[*]} " == *" $t "* ]] || die "unknown target '$t' (one of: ${all_targets[*]})"
done

# The targets. fuzz/ is a workspace of its own with its own Cargo.lock: it must be up to date
# (cargo would rewrite it silently otherwise).
start=$SECONDS
cargo fetch --quiet --locked --manifest-path "$fuzz_dir/Cargo.toml" ||
	die "fuzz/Cargo.lock is not up to date with the workspace (cargo fetch --manifest-path fuzz/Cargo.toml updates it)"
bin_dir="$target_dir/ci"
build=()
# One cargo build for all of them; a single target, alone.
$prepare_only || ((${#targets[@]} == ${#all_targets[@]})) || build=("${targets[@]}")
bins=()
for t in "${build[@]}"; do bins+=(--bin "$t"); done
RUSTC_WRAPPER="$fuzz_dir/instrument-rustc.sh" cargo build --quiet --locked \
	--manifest-path "$fuzz_dir/Cargo.toml" --profile ci --target-dir "$target_dir" "${bins[@]}" >&2 ||
	die "the fuzz build (${build[*]:-every target}) failed"
log "built ${build[*]:-every target} in $((SECONDS - start)) s ($bin_dir)"
if $prepare_only; then
	exit 0
fi

work=${KILOTUN_FUZZ_WORK:-$(mktemp -d /tmp/kilotun-fuzz.XXXXXX)}
mkdir -p "$work"
status=0
for t in "${targets[@]}"; do
	corpus="$fuzz_dir/corpus/$t"
	new="$work/$t/new"
	artifacts="$work/$t/artifacts"
	rm -rf "${work:?}/$t"
	mkdir -p "$new" "$artifacts" "$corpus"
	before=$(find "$corpus" -maxdepth 1 -type f | wc -l)
	# The scratch directory first: libFuzzer writes new inputs into the first corpus directory.
	dirs=("$new" "$corpus")
	from="the $before inputs of fuzz/corpus/$t"
	if $ci && [[ $t == agents ]]; then
		# One input is a whole cluster of agents run to convergence (about a second here, the
		# committed corpus's longest 10 s): replaying the corpus alone takes longer than CI's
		# time, and `cargo test` replays it already. CI's run starts from nothing.
		dirs=("$new")
		from="an empty corpus"
	fi
	log "$t: ${seconds} s from $from"
	rc=0
	# libFuzzer ends at -max_total_time once it has run the corpus it was given; SIGINT (its
	# "run interrupted", exit 72, final stats printed) ends a corpus that takes longer than that.
	(cd "$work/$t" && timeout --preserve-status -s INT -k 30 "$((seconds + 10))" \
		"$bin_dir/$t" -max_total_time="$seconds" -timeout=60 -rss_limit_mb=4096 \
		-print_final_stats=1 -artifact_prefix="$artifacts/" "${dirs[@]}") >"$work/$t/log" 2>&1 || rc=$?
	# libFuzzer's last status line ("#N DONE cov: C ft: F corp: ...", or the last "pulse" or
	# "NEW" line before a crash or an interrupt) and its final stats.
	last=$(grep -E '^#[0-9]+' "$work/$t/log" | tail -1 || true)
	execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/$t/log")
	[[ -n $execs ]] || execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' <<<"$last")
	cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
	ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
	rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$work/$t/log")
	added=$(find "$new" -type f | wc -l)
	note=
	grep -q 'INITED' "$work/$t/log" || note=", stopped before the corpus was replayed"
	# Inputs slower than 10 s (libFuzzer's slow-unit-*) are listed, not failures.
	mapfile -t slow < <(find "$artifacts" -type f -name 'slow-unit-*' | sort)
	((${#slow[@]} == 0)) || note+=", slow inputs (over 10 s): ${slow[*]}"
	mapfile -t found < <(find "$artifacts" -type f ! -name 'slow-unit-*' | sort)
	crash=none
	if ((${#found[@]})) || { ((rc)) && ((rc != 72)); }; then
		status=1
		crash="exit $rc${found[0]:+: ${found[*]}}"
		grep -E -m1 -A12 "panicked at|ERROR: libFuzzer|==ERROR|SUMMARY" "$work/$t/log" >&2 || tail -20 "$work/$t/log" >&2
		for f in "${found[@]}"; do
			log "$t: replay with: $bin_dir/$t $f"
			if ! $ci; then
				cp "$f" "$corpus/$(basename "$f")"
				log "$t: copied $(basename "$f") into fuzz/corpus/$t/ (cargo test replays it)"
			fi
		done
	fi
	merged=
	if ! $ci && ((added)); then
		# Only the new inputs that add coverage to the committed corpus. An input of agents
		# is a whole cluster run (`cargo test` replays each in about 0.2 s), and nearly every
		# one reaches some new hit count of the model's code: its inputs are kept only for the
		# edges they reach first (-use_counters=0), not for new counts of edges already reached.
		local_flags=()
		[[ $t == agents ]] && local_flags=(-use_counters=0)
		(cd "$work/$t" && "$bin_dir/$t" -merge=1 "${local_flags[@]}" -timeout=60 -rss_limit_mb=4096 \
			-artifact_prefix="$artifacts/" "$corpus" "$new") >"$work/$t/merge.log" 2>&1 ||
			{ log "$t: the merge failed (log: $work/$t/merge.log)"; status=1; }
		merged=", $(($(find "$corpus" -maxdepth 1 -type f | wc -l) - before)) merged into fuzz/corpus/$t"
	fi
	log "$t: ${execs:-?} execs in ${seconds} s (${rate:-?}/s), cov: ${cov:-?} ft: ${ft:-?}, $added new inputs$merged, crash: $crash$note"
done
log "logs: $work/<target>/log"
exit "$status"
