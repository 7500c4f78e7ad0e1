#!/usr/bin/env bash
# The supply-chain checks of the crates kilotun is built from: every crate of Cargo.lock (and of
# fuzz/Cargo.lock, the fuzzers' workspace) against the RustSec advisory database, offline, and
# against deny.toml's licence allow-list, both by cargo-deny:
#
#   scripts/audit.sh             # check (building the cache first if need be); prints the findings
#   scripts/audit.sh --prepare   # only fill the cache; prints the cargo-deny binary's path
#
# What fails (non-zero exit): a vulnerability advisory that applies to a crate's locked version,
# a crate whose licence is outside deny.toml's allow-list, a crate with no licence, a deny.toml
# that cargo-deny rejects. Listed as warnings, not failing: advisories that a crate is
# unmaintained or unsound, notices, yanked versions (offline, from cargo's local index cache).
# All features of every crate and all targets count: the whole lock file, not one build of it.
#
# The advisory database is a snapshot of github.com/rustsec/advisory-db, a plain directory (its
# crates/ folder, and SNAPSHOT naming the upstream commit and its date):
# KILOTUN_ADVISORY_DB, by default ../shared/advisory-db beside the clone (CI lays shared/ there).
# cargo-deny reads a git checkout (it takes the database's age from the HEAD commit), so the
# snapshot is copied once into one, committed with the snapshot's date as author and committer
# (the same commit on every machine), under
#   CACHE/advisory-db-<upstream commit>/advisory-db-3157b0e258782691
# (the directory name cargo-deny derives from the database's default URL; deny.toml's db-path
# points at its parent through KILOTUN_ADVISORY_DBS, which this script sets; its
# maximum-db-staleness is long: the snapshot's date, printed, is the snapshot's business). The
# database is never fetched: cargo-deny runs with --offline, after `cargo fetch --locked` has
# downloaded from the registry whatever crates of the lock files a build did not (other
# targets'). Without the snapshot, with CI set this fails; otherwise the licences are checked
# and the advisories skipped, with a line saying so.
#
# cargo-deny 0.20.2 is built from crates.io once (`cargo install --locked`, in its own temporary
# target directory) into CACHE/cargo-deny-0.20.2/bin/cargo-deny, where CACHE is
# ${KILOTUN_CACHE:-/var/cache/kilotun}; later runs only use it (no lock, no network). The build
# takes about 350 CPU seconds (docs/testing.md, "Supply chain"): run --prepare under `nice` on a
# shared machine. Concurrent callers serialise on one lock per cache entry.
set -euo pipefail

readonly CARGO_DENY_VERSION=0.20.2
# cargo-deny's directory for https://github.com/rustsec/advisory-db (its url_to_db_path: the
# URL's last path segment and its XxHash64): what it opens under db-path with --offline.
readonly DB_DIR_NAME=advisory-db-3157b0e258782691

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(cd "$script_dir/.." && pwd -P)
cache_root=${KILOTUN_CACHE:-/var/cache/kilotun}
snapshot=$(realpath -m "${KILOTUN_ADVISORY_DB:-$repo_root/../shared/advisory-db}")

log() { printf 'audit.sh: %s\n' "$*" >&2; }
die() {
	log "error: $*"
	exit 1
}

prepare_only=false
for arg; do
	case $arg in
	--prepare) prepare_only=true ;;
	*) die "unknown argument '$arg' (usage: $0 [--prepare])" ;;
	esac
done

case "$(realpath -m "$cache_root")/" in
"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
esac

# Takes the lock for cache entry $1 (waiting for another caller if need be) on descriptor 9.
lock() {
	mkdir -p "$cache_root" || die "cannot create $cache_root (set KILOTUN_CACHE to a writable directory)"
	exec 9>"$cache_root/.$1.lock"
	if ! flock -n 9; then
		log "another caller holds $cache_root/.$1.lock; waiting for it"
		flock 9
	fi
}

deny_dir="$cache_root/cargo-deny-$CARGO_DENY_VERSION"
deny="$deny_dir/bin/cargo-deny"
if [[ ! -x $deny ]]; then
	lock "cargo-deny-$CARGO_DENY_VERSION"
	if [[ ! -x $deny ]]; then
		command -v cargo >/dev/null || die "cargo not found; cargo-deny $CARGO_DENY_VERSION is built from crates.io"
		start=$SECONDS
		log "cargo-deny $CARGO_DENY_VERSION: cargo install --locked cargo-deny@$CARGO_DENY_VERSION"
		work=$(mktemp -d "$cache_root/.cargo-deny.XXXXXX")
		# shellcheck disable=SC2064 # expand $work now
		trap "rm -rf '$work'" EXIT
		# Its own temporary target directory, not a shared CARGO_TARGET_DIR (whose lock would make
		# it wait for, or hold up, a concurrent build of the workspace).
		env -u CARGO_TARGET_DIR -u CARGO_BUILD_TARGET_DIR CARGO_TARGET_DIR="$work/target" \
			cargo install --quiet --locked --root "$work/root" "cargo-deny@$CARGO_DENY_VERSION" >&2 ||
			die "cargo install cargo-deny@$CARGO_DENY_VERSION failed"
		"$work/root/bin/cargo-deny" --version >&2 || die "the cargo-deny just built does not run"
		rm -rf "$deny_dir"
		mv -T "$work/root" "$deny_dir"
		rm -rf "$work"
		trap - EXIT
		log "cargo-deny $CARGO_DENY_VERSION: $((SECONDS - start)) s"
	fi
	exec 9>&-
fi

# The snapshot as the git checkout cargo-deny reads; sets db_root (empty: no snapshot).
db_root=
snapshot_line=
if [[ -d $snapshot/crates ]]; then
	[[ -r $snapshot/SNAPSHOT ]] || die "$snapshot has no SNAPSHOT file naming its upstream commit"
	snapshot_line=$(head -1 "$snapshot/SNAPSHOT")
	# "rustsec/advisory-db at commit <40 hex> (<date>)"
	commit=$(sed -n 's/.* at commit \([0-9a-f]\{40\}\) .*/\1/p' <<<"$snapshot_line")
	date=$(sed -n 's/.* (\(.*\))$/\1/p' <<<"$snapshot_line")
	[[ -n $commit && -n $date ]] || die "cannot read the commit and date in $snapshot/SNAPSHOT: '$snapshot_line'"
	db_root="$cache_root/advisory-db-$commit"
	if ! git -C "$db_root/$DB_DIR_NAME" rev-parse -q --verify HEAD >/dev/null 2>&1; then
		lock "advisory-db-$commit"
		if ! git -C "$db_root/$DB_DIR_NAME" rev-parse -q --verify HEAD >/dev/null 2>&1; then
			command -v git >/dev/null || die "git not found; cargo-deny reads the advisory database from a git checkout"
			log "advisory-db: $snapshot ($snapshot_line) into $db_root/$DB_DIR_NAME"
			work=$(mktemp -d "$cache_root/.advisory-db.XXXXXX")
			# shellcheck disable=SC2064 # expand $work now
			trap "rm -rf '$work'" EXIT
			# The snapshot may come without write bits (CI's copy of shared/ does).
			cp -R --no-preserve=mode "$snapshot" "$work/$DB_DIR_NAME"
			(
				cd "$work/$DB_DIR_NAME"
				export GIT_AUTHOR_NAME=kilotun GIT_AUTHOR_EMAIL=kilotun@localhost \
					GIT_COMMITTER_NAME=kilotun GIT_COMMITTER_EMAIL=kilotun@localhost \
					GIT_AUTHOR_DATE="$date" GIT_COMMITTER_DATE="$date" GIT_CONFIG_GLOBAL=/dev/null GIT_CONFIG_SYSTEM=/dev/null
				git init -q -b main
				git add -A
				git commit -q -m "$snapshot_line"
			) >&2 || die "cannot make a git repository of $snapshot"
			mkdir -p "$db_root"
			rm -rf "${db_root:?}/$DB_DIR_NAME"
			mv -T "$work/$DB_DIR_NAME" "$db_root/$DB_DIR_NAME"
			rm -rf "$work"
			trap - EXIT
		fi
		exec 9>&-
	fi
elif [[ -n ${CI:-} ]]; then
	die "no advisory database at $snapshot (a copy of rustsec/advisory-db with crates/ and SNAPSHOT; set KILOTUN_ADVISORY_DB)"
fi

if $prepare_only; then
	printf '%s\n' "$deny"
	exit 0
fi

checks=(licenses)
if [[ -n $db_root ]]; then
	checks=(advisories licenses)
	log "advisories from $snapshot_line ($(git -C "$db_root/$DB_DIR_NAME" ls-files 'crates/*.md' | wc -l) advisories for crates)"
else
	log "no advisory database at $snapshot (set KILOTUN_ADVISORY_DB): advisories not checked, licences only"
fi

# deny.toml's db-path reads KILOTUN_ADVISORY_DBS; without a snapshot it points nowhere used.
export KILOTUN_ADVISORY_DBS=${db_root:-/nonexistent}
status=0
for manifest in Cargo.toml fuzz/Cargo.toml; do
	# cargo-deny reads `cargo metadata`, which needs every crate of the lock file, each target's
	# included (a build fetched the host's only): cargo fetches the rest from the registry, and
	# cargo-deny itself then runs offline.
	cargo fetch --quiet --locked --manifest-path "$repo_root/$manifest" ||
		die "cargo fetch --locked --manifest-path $manifest failed"
	log "$manifest: cargo deny check ${checks[*]}"
	# -W: informational advisories and yanked versions are listed, as warnings; a vulnerability,
	# an unlisted licence and every other error fail.
	"$deny" --manifest-path "$repo_root/$manifest" --config "$repo_root/deny.toml" \
		--offline --locked --all-features check --show-stats \
		-W unmaintained -W unsound -W notice -W yanked "${checks[@]}" || status=1
done
if ((status)); then
	log "FAILED: a vulnerability, a licence outside deny.toml's allow-list, or another error above"
else
	log "ok: ${db_root:+no vulnerability applies, }every licence allowed (warnings, if any, above)"
fi
exit "$status"
