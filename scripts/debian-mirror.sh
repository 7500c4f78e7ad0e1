# Shared by the scripts that fetch from Debian (sourced, not run): kube-apiserver.sh, kube-node-bins.sh, kilo.sh, engines.sh, cross-build.sh, image/build.sh.
#
# detect_mirror prints the Debian mirror this machine uses: the URI of the first enabled bookworm
# entry, in one-line (`deb [opts] URI bookworm main`) or deb822 (`URIs:` / `Suites:` stanza)
# format. require_mirror is what the callers use: the override they pass, else that mirror, else
# it stops with a message naming KILOTUN_DEBIAN_MIRROR (no public host is assumed: air-gapped
# builders use their own).
detect_mirror() {
	local f
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[[ -r $f ]] || continue
		awk '$1 == "deb" || $1 == "deb-src" {
			i = 2
			if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
			if ($(i + 1) == "bookworm") { print $i; exit }
		}' "$f"
	done
	for f in /etc/apt/sources.list.d/*.sources; do
		[[ -r $f ]] || continue
		awk 'BEGIN { RS = ""; FS = "\n" }
		{
			uri = ""; bookworm = 0; enabled = 1
			for (i = 1; i <= NF; i++) {
				if ($i ~ /^URIs:/) { split($i, a, /[ \t]+/); uri = a[2] }
				if ($i ~ /^Suites:/ && $i ~ /[ \t]bookworm([ \t]|$)/) bookworm = 1
				if ($i ~ /^Enabled:[ \t]*no/) enabled = 0
			}
			if (uri != "" && bookworm && enabled) { print uri; exit }
		}' "$f"
	done
}

# require_mirror [OVERRIDE]: prints OVERRIDE, or the mirror this machine's apt uses for bookworm,
# without a trailing slash; exits 1 naming the variable to set when there is neither.
require_mirror() {
	local mirror=${1:-$(detect_mirror | head -n1)}
	if [[ -z $mirror ]]; then
		echo "no Debian mirror: this machine's apt sources list no bookworm entry; set KILOTUN_DEBIAN_MIRROR to your mirror's URL" >&2
		exit 1
	fi
	echo "${mirror%/}"
}
