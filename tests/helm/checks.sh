# Sourced by tests/helm/*.sh: the pass and fail counters each script ends with.
passed=0
failed=0
ok() {
	passed=$((passed + 1))
	echo "  ok: $*"
}
bad() {
	failed=$((failed + 1))
	echo "  FAIL: $*"
}
