#!/usr/bin/env bash
# RUSTC_WRAPPER for fuzz/run.sh's build: cargo runs `instrument-rustc.sh RUSTC ARGS...` for every
# crate. The code under test (kilotun's own packages and the patched boringtun) gets libFuzzer's
# instrumentation, the flags cargo-fuzz 0.13 passes to every crate (SanitizerCoverage with 8-bit
# counters, the PC table, comparison tracing and stack depth; `--cfg fuzzing`; debug assertions
# and overflow checks). Every other crate is compiled exactly as the workspace's `ci` test build
# compiles it, so cargo reuses that build's artifacts instead of building them a second time:
# fuzz/Cargo.toml gives these five packages profile overrides, which give their instrumented
# artifacts names of their own (the test build's are never overwritten).
set -euo pipefail
rustc=$1
shift
case "${CARGO_PKG_NAME:-}" in
dataplane | control | kilotun | kilotun-fuzz | boringtun)
	# A build script is a host program, not code under test.
	for arg in "$@"; do
		[[ $arg != build_script_build ]] || exec "$rustc" "$@"
	done
	exec "$rustc" "$@" \
		-Cpasses=sancov-module \
		-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
		-Cllvm-args=-sanitizer-coverage-level=4 \
		-Cllvm-args=-sanitizer-coverage-pc-table \
		-Cllvm-args=-sanitizer-coverage-trace-compares \
		-Cllvm-args=-sanitizer-coverage-stack-depth \
		-Cllvm-args=-simplifycfg-branch-fold-threshold=0 \
		--cfg fuzzing
	;;
*) exec "$rustc" "$@" ;;
esac
