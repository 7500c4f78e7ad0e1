# shellcheck shell=bash disable=SC2154,SC2034 # the caller sets cache_dir, repo_root, cache_root; it reads total_start
# The skeleton the cache builders share (sourced, not run: scripts/kube-apiserver.sh,
# scripts/kube-node-bins.sh, scripts/kilo.sh, and private_apt for scripts/engines.sh).
#
# A builder defines log() and die(), sets cache_root, repo_root and cache_dir, checks its own
# fast path, then calls
#   cache_lock NAME      the cache must be outside the repository; one builder of NAME at a time
#                        (flock on fd 9, held until exit); the caller re-checks its cache after it
#   cache_workdir NAME   $work: a temporary directory under the cache root (same filesystem, so
#                        publishing is an atomic rename), removed on exit whatever happens
#   phase NAME           logs how long the previous phase took and starts the next ('' ends)
#   private_apt DIR LINE...  apt with its own sources (LINEs), lists and caches under DIR, in
#                        the array apt_opts: the machine's apt sources and lists are neither read
#                        nor changed (other apt.conf settings, a proxy say, still apply)

cache_lock() {
	local name=$1
	case "$(realpath -m "$cache_dir")/" in
	"$repo_root"/*) die "KILOTUN_CACHE ($cache_root) is inside the repository $repo_root; pick a directory outside it" ;;
	esac
	mkdir -p "$cache_root" || die "cannot create cache root $cache_root (set KILOTUN_CACHE to a writable directory)"
	exec 9>"$cache_root/.$name.lock"
	if ! flock -n 9; then
		log "another build holds $cache_root/.$name.lock; waiting for it"
		flock 9
	fi
}

cache_workdir() {
	work=$(mktemp -d "$cache_root/.$1.build.XXXXXX")
	trap cache_workdir_remove EXIT
	# An interrupt becomes a normal exit, so the EXIT trap runs.
	trap 'exit 130' INT
	trap 'exit 143' TERM
}

cache_workdir_remove() {
	# Go leaves its module and build caches read-only: a plain rm first (walking the tree twice
	# is slow), then again after making everything writable.
	rm -rf "$work" 2>/dev/null || { chmod -R u+w "$work" && rm -rf "$work"; }
}

total_start=$SECONDS
phase_start=$SECONDS
phase_name=
phase() {
	if [[ -n $phase_name ]]; then
		log "phase $phase_name: $((SECONDS - phase_start))s"
	fi
	phase_name=$1
	phase_start=$SECONDS
	[[ -z $phase_name ]] || log "phase $phase_name ..."
}

private_apt() {
	local dir=$1
	shift
	mkdir -p "$dir/lists/partial" "$dir/archives/partial" "$dir/cache"
	printf '%s\n' "$@" >"$dir/sources.list"
	apt_opts=(
		-q
		-o "Dir::Etc::SourceList=$dir/sources.list"
		-o Dir::Etc::SourceParts=/dev/null
		-o Dir::Etc::Preferences=/dev/null
		-o Dir::Etc::PreferencesParts=/dev/null
		-o "Dir::State::Lists=$dir/lists"
		-o "Dir::Cache=$dir/cache"
		-o "Dir::Cache::archives=$dir/archives"
		# Only Packages/Sources indexes: no AppStream metadata, icons or Contents files.
		-o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
		-o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
		-o Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false
		-o Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false
		-o Acquire::Languages=none
		# The directory is private to root; apt's _apt sandbox user could not write it.
		-o APT::Sandbox::User=root
	)
}
