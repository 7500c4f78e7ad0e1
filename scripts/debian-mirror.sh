# Shared by scripts/kube-apiserver.sh and scripts/engines.sh (sourced, not run).
#
# detect_mirror prints the Debian mirror this machine uses: the URI of the first enabled bookworm
# entry, in one-line (`deb [opts] URI bookworm main`) or deb822 (`URIs:` / `Suites:` stanza)
# format. The callers fall back to deb.debian.org when it prints nothing.
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
