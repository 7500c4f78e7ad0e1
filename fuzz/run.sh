#!/usr/bin/env bash
# Runs the libFuzzer targets of fuzz/fuzz_targets/ (cargo-fuzz), each for a fixed time:
#
#   fuzz/run.sh [--seconds N] [TARGET...]        # default: an hour each, every target, in turn
#   fuzz/run.sh --ci [--seconds N] [TARGET...]   # what .ci/run does (20 s each)
#   fuzz/run.sh --prepare                        # only build cargo-fuzz and the targets
#
# TARGET is one of the targets of fuzz/Cargo.toml (default: all seven). Each target starts from
# its committed corpus, fuzz/corpus/TARGET/, which `cargo test` replays (control/src/fuzzing.rs,
# dataplane/src/fuzzing.rs, src/model/). libFuzzer writes the inputs that reach new coverage into
# a scratch directory, never into the repository while it runs. At the end of a target's run:
#   without --ci  the new inputs that still add coverage are merged into fuzz/corpus/TARGET/
#                 (libFuzzer's -merge=1: only those that add features to what the corpus has),
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
# The build: cargo-fuzz 0.13.2, built from crates.io once into
# ${KILOTUN_CACHE:-/var/cache/kilotun}/cargo-fuzz-0.13.2/bin/cargo-fuzz (like scripts/audit.sh's
# cargo-deny: a lock, a versioned directory, later runs only use it), then
#   cargo fuzz build -O -a --sanitizer none --codegen-units 16
# on this stable toolchain (RUSTC_BOOTSTRAP=1 lets it take the flags cargo-fuzz passes): release
# with debug assertions and overflow checks, LLVM's SanitizerCoverage, no AddressSanitizer (its
# checks are for the memory errors of unsafe code, of which the fuzzed paths have little; it
# slows the build and every execution), 16 code-generation units (a faster build than
# cargo-fuzz's default of 1, for somewhat slower fuzzing; opt-level 1 instead of 3 saved
# nothing measurable). It is a second build of nearly everything kilotun links, about 1,200 CPU
# seconds from nothing (docs/testing.md, "Fuzzing"). Its own target directory,
# KILOTUN_FUZZ_TARGET_DIR, by default ${CARGO_TARGET_DIR:-target}/fuzz: the instrumented build
# shares nothing with the workspace's, and holds no lock of it.
set -euo pipefail

readonly CARGO_FUZZ_VERSION=0.13.2
readonly TRIPLE=x86_64-unknown-linux-gnu

fuzz_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo_root=$(cd "$fuzz_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
target_dir=${KILOTUN_FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:-$repo_root/target}/fuzz}

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

case "$(realpath -m "$cache_root")/" in
"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
esac

# cargo-fuzz, once. Its own release profile is fat LTO with one code-generation unit; the tool
# only drives cargo, so it is built at opt-level 1, without LTO, in parallel (much less CPU).
fuzz_tool_dir="$cache_root/cargo-fuzz-$CARGO_FUZZ_VERSION"
cargo_fuzz="$fuzz_tool_dir/bin/cargo-fuzz"
if [[ ! -x $cargo_fuzz ]]; then
	mkdir -p "$cache_root" || die "cannot create $cache_root (set KILOTUN_CACHE to a writable directory)"
	exec 9>"$cache_root/.cargo-fuzz-$CARGO_FUZZ_VERSION.lock"
	if ! flock -n 9; then
		log "another caller holds $cache_root/.cargo-fuzz-$CARGO_FUZZ_VERSION.lock; waiting for it"
		flock 9
	fi
	if [[ ! -x $cargo_fuzz ]]; then
		start=$SECONDS
		log "cargo-fuzz $CARGO_FUZZ_VERSION: cargo install --locked cargo-fuzz@$CARGO_FUZZ_VERSION"
		work=$(mktemp -d "$cache_root/.cargo-fuzz.XXXXXX")
		# shellcheck disable=SC2064 # expand $work now
		trap "rm -rf '$work'" EXIT
		env -u CARGO_BUILD_TARGET_DIR CARGO_TARGET_DIR="$work/target" \
			CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 \
			CARGO_PROFILE_RELEASE_OPT_LEVEL=1 \
			cargo install --quiet --locked --root "$work/root" "cargo-fuzz@$CARGO_FUZZ_VERSION" >&2 ||
			die "cargo install cargo-fuzz@$CARGO_FUZZ_VERSION failed"
		"$work/root/bin/cargo-fuzz" --version >&2 || die "the cargo-fuzz just built does not run"
		rm -rf "$fuzz_tool_dir"
		mv -T "$work/root" "$fuzz_tool_dir"
		rm -rf "$work"
		trap - EXIT
		log "cargo-fuzz $CARGO_FUZZ_VERSION: $((SECONDS - start)) s"
	fi
	exec 9>&-
fi

# The targets. fuzz/ is a workspace of its own with its own Cargo.lock: it must be up to date
# (cargo would rewrite it silently otherwise).
start=$SECONDS
cargo fetch --quiet --locked --manifest-path "$fuzz_dir/Cargo.toml" ||
	die "fuzz/Cargo.lock is not up to date with the workspace (cargo fetch --manifest-path fuzz/Cargo.toml updates it)"
bin_dir="$target_dir/$TRIPLE/release"
build=()
# One cargo build for all of them; a single target, alone.
$prepare_only || ((${#targets[@]} == ${#all_targets[@]})) || build=("${targets[@]}")
for t in "${build[@]:-}"; do
	RUSTC_BOOTSTRAP=1 "$cargo_fuzz" build --fuzz-dir "$fuzz_dir" -O -a --sanitizer none \
		--codegen-units 16 --target-dir "$target_dir" ${t:+"$t"} >&2 ||
		die "cargo fuzz build ${t:-(every target)} failed"
done
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
		# Only the new inputs that add coverage to the committed corpus.
		(cd "$work/$t" && "$bin_dir/$t" -merge=1 -timeout=60 -rss_limit_mb=4096 \
			-artifact_prefix="$artifacts/" "$corpus" "$new") >"$work/$t/merge.log" 2>&1 ||
			{ log "$t: the merge failed (log: $work/$t/merge.log)"; status=1; }
		merged=", $(($(find "$corpus" -maxdepth 1 -type f | wc -l) - before)) merged into fuzz/corpus/$t"
	fi
	log "$t: ${execs:-?} execs in ${seconds} s (${rate:-?}/s), cov: ${cov:-?} ft: ${ft:-?}, $added new inputs$merged, crash: $crash$note"
done
log "logs: $work/<target>/log"
exit "$status"
