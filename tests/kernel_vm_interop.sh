#!/usr/bin/env bash
# kilotun against the kernel's own WireGuard, and the kernel modules kg relies on, under one of
# Debian's kernels: what tests/real/kernel_vm.rs runs inside scripts/kernel-vm.sh's virtual machine
# (this machine's kernel has neither wireguard nor ipip):
#
#   scripts/kernel-vm.sh --kernel 6.1 -- bash tests/kernel_vm_interop.sh target/ci/kilotun
#
# It checks, printing a `KVM_OK <what> [at <seconds since the start> s]` line for each step that passes:
#   wireguard-module  `ip link add ... type wireguard` loads the module (wireguard, udp_tunnel,
#                     ip6_udp_tunnel, libchacha20poly1305, curve25519...) and makes a device;
#   ipip-module       an ipip tunnel loads ipip (and tunnel4, ip_tunnel): the fallback tunl0
#                     appears and `ip tunnel show` lists the new tunnel;
#   handshake-kernel-initiated, handshake-kilotun-initiated
#                     kilotun in one network namespace, the kernel's WireGuard in another, joined
#                     by a veth pair: a fresh kernel peer starts the handshake and kilotun answers,
#                     then a fresh kilotun peer starts it and the kernel answers;
#   ping              both ways, IPv4 and IPv6 inside the tunnel;
#   transfer          4 MiB of random data each way (kilotun to kernel over IPv4, back over IPv6,
#                     TCP with socat), byte for byte identical (sha256);
#   dump              `wg show dump` of both ends agree: each one's public key, listen port and
#                     address are what the other has for its peer, the allowed IPs are printed
#                     alike, and each one's transmitted bytes are within 10% of what the other
#                     received;
#   roaming           kilotun changes its listen port, then its namespace's address (the old one
#                     removed), and the kernel does the same: each time the other end, its
#                     configuration untouched, takes the new endpoint from the moved end's
#                     authenticated packets (`wg show endpoints` before and after) and pings pass
#                     both ways;
#   peer-readd        the peer removed on the kernel's end stops all traffic (no ping passes
#                     either way); added again (same allowed IPs and endpoint) it handshakes anew
#                     (a later latest-handshake on both ends) and pings pass; then the same on
#                     kilotun's end;
# and ends with `KVM_INTEROP_PASS kernel=<release>`. Any failure stops it with a message and a
# non-zero exit status. Everything it makes (namespaces, links, kilotun) goes on exit.
#
# Needs root, iproute2, wireguard-tools, iputils-ping, socat, kmod (modprobe), and a kernel with
# the wireguard, ipip and veth modules; the argument (or KILOTUN_BIN) is the kilotun binary,
# target/ci/kilotun by default.
set -euo pipefail

kilotun=${1:-${KILOTUN_BIN:-target/ci/kilotun}}
kilotun=$(realpath "$kilotun")
[[ -x $kilotun ]] || { echo "FAIL: no kilotun binary at $kilotun" >&2; exit 1; }
for tool in ip wg ping socat sha256sum modprobe; do
	command -v "$tool" >/dev/null || { echo "FAIL: $tool not found" >&2; exit 1; }
done

ok() { echo "KVM_OK $* [at ${SECONDS} s]"; }
fail() {
	echo "FAIL: $*" >&2
	exit 1
}

a=kvma$$ b=kvmb$$ c=kvmc$$
work=$(mktemp -d /tmp/kernel-vm-interop.XXXXXX)
kilotun_pid=
cleanup() {
	local rc=$?
	if [[ -n $kilotun_pid ]]; then
		kill "$kilotun_pid" 2>/dev/null || true
		wait "$kilotun_pid" 2>/dev/null || true
	fi
	if ((rc != 0)) && [[ -s $work/kilotun.log ]]; then
		echo "--- kilotun's log:" >&2
		tail -n 30 "$work/kilotun.log" >&2
	fi
	for ns in "$a" "$b" "$c"; do ip netns del "$ns" 2>/dev/null || true; done
	rm -rf "$work"
	exit "$rc"
}
trap cleanup EXIT

echo "kernel $(uname -r); kilotun $("$kilotun" --version 2>&1 | head -n1)"

# --- the modules ---------------------------------------------------------------------------------
ip netns add "$c"
ip -n "$c" link add kvmwg0 type wireguard || fail "ip link add type wireguard (modprobe wireguard: $(modprobe -n -v wireguard 2>&1))"
ip -n "$c" -d link show kvmwg0 | grep -q wireguard || fail "kvmwg0 is no wireguard device"
for m in wireguard udp_tunnel ip6_udp_tunnel; do
	grep -q "^$m " /proc/modules || fail "module $m is not loaded"
done
ok "wireguard-module ($(grep -oE '^(wireguard|udp_tunnel|ip6_udp_tunnel|libchacha[a-z0-9_]*|libcurve25519[a-z_]*|curve25519[a-z0-9_]*) ' /proc/modules | tr -d ' ' | sort | tr '\n' ' '))"

ip -n "$c" link add kvmipip0 type ipip local 192.0.2.1 remote 192.0.2.2 || fail "ip link add type ipip"
grep -q "^ipip " /proc/modules || fail "module ipip is not loaded"
ip -n "$c" link show tunl0 >/dev/null || fail "no tunl0 after loading ipip"
ip -n "$c" tunnel show | grep -Eq '^kvmipip0: [a-z]+/ip +remote 192.0.2.2 +local 192.0.2.1' ||
	fail "ip tunnel show does not list kvmipip0: $(ip -n "$c" tunnel show)"
ip -n "$c" tunnel add kvmipip1 mode ipip local 192.0.2.1 remote 192.0.2.3 || fail "ip tunnel add mode ipip"
ok "ipip-module ($(grep -oE '^(ipip|tunnel4|ip_tunnel) ' /proc/modules | tr -d ' ' | sort | tr '\n' ' '))"
ip netns del "$c"

# --- kilotun (a) and the kernel's WireGuard (b) ----------------------------------------------------
ip netns add "$a"
ip netns add "$b"
ip link add kvmva type veth peer name kvmvb
ip link set kvmva netns "$a"
ip link set kvmvb netns "$b"
ip -n "$a" addr add 192.168.210.1/24 dev kvmva
ip -n "$b" addr add 192.168.210.2/24 dev kvmvb
for ns in "$a" "$b"; do
	ip -n "$ns" link set lo up
	ip -n "$ns" link set "kvmv${ns:3:1}" up
done

umask 077
wg genkey >"$work/a.key"
wg genkey >"$work/b.key"
pub_a=$(wg pubkey <"$work/a.key")
pub_b=$(wg pubkey <"$work/b.key")

ip netns exec "$a" "$kilotun" -f --threads 2 kvmwga >"$work/kilotun.log" 2>&1 &
kilotun_pid=$!
for _ in $(seq 100); do
	[[ -S /var/run/wireguard/kvmwga.sock ]] && break
	kill -0 "$kilotun_pid" 2>/dev/null || fail "kilotun exited: $(cat "$work/kilotun.log")"
	sleep 0.1
done
[[ -S /var/run/wireguard/kvmwga.sock ]] || fail "kilotun made no /var/run/wireguard/kvmwga.sock"
ip -n "$b" link add kvmwgb type wireguard

wga() { ip netns exec "$a" wg "$@"; }
wgb() { ip netns exec "$b" wg "$@"; }
wga set kvmwga private-key "$work/a.key" listen-port 51820
wgb set kvmwgb private-key "$work/b.key" listen-port 51821
ip -n "$a" addr add 10.71.0.1/24 dev kvmwga
ip -n "$a" addr add fd71::1/64 dev kvmwga
ip -n "$b" addr add 10.71.0.2/24 dev kvmwgb
ip -n "$b" addr add fd71::2/64 dev kvmwgb
ip -n "$a" link set kvmwga up
ip -n "$b" link set kvmwgb up
# Each end's underlay endpoint, as the other configures it (the roaming step moves them).
ep_a=192.168.210.1:51820 ep_b=192.168.210.2:51821
add_peer_a() { wga set kvmwga peer "$pub_b" endpoint "$ep_b" allowed-ips 10.71.0.2/32,fd71::2/128; }
add_peer_b() { wgb set kvmwgb peer "$pub_a" endpoint "$ep_a" allowed-ips 10.71.0.1/32,fd71::1/128; }
add_peer_a
add_peer_b

# handshake_of NS DEVICE KEY: the peer's latest handshake (seconds since the epoch, 0: none).
handshake_of() { ip netns exec "$1" wg show "$2" latest-handshakes | awk -v k="$3" '$1 == k { print $2 }'; }
# ping_until NS TARGET: one answer within 10 s.
ping_until() {
	local _
	for _ in $(seq 10); do
		ip netns exec "$1" ping -n -c 1 -W 1 "$2" >/dev/null 2>&1 && return 0
	done
	return 1
}

# The kernel starts: neither end has a session; b's first packet makes b initiate.
ping_until "$b" 10.71.0.1 || fail "ping kernel -> kilotun (kernel-initiated handshake)"
hs_b=$(handshake_of "$b" kvmwgb "$pub_a")
hs_a=$(handshake_of "$a" kvmwga "$pub_b")
[[ $hs_b != 0 && $hs_a != 0 ]] || fail "no handshake recorded after the kernel's ping (kernel $hs_b, kilotun $hs_a)"
ok "handshake-kernel-initiated (kernel $hs_b, kilotun $hs_a)"

# Then kilotun: its peer removed and added again has no session, so its first packet makes it
# initiate; the kernel answers (replacing its session).
wga set kvmwga peer "$pub_b" remove
add_peer_a
[[ $(handshake_of "$a" kvmwga "$pub_b") == 0 ]] || fail "kilotun's re-added peer has a handshake already"
ping_until "$a" 10.71.0.2 || fail "ping kilotun -> kernel (kilotun-initiated handshake)"
hs_a=$(handshake_of "$a" kvmwga "$pub_b")
[[ $hs_a != 0 ]] || fail "kilotun recorded no handshake after its ping"
ok "handshake-kilotun-initiated (kilotun $hs_a)"

for target in "$a 10.71.0.2" "$b 10.71.0.1" "$a fd71::2" "$b fd71::1"; do
	read -r ns ip <<<"$target"
	out=$(ip netns exec "$ns" ping -n -c 3 -i 0.2 -W 2 "$ip" 2>&1) || fail "ping $ip from $ns: $out"
done
ok "ping (IPv4 and IPv6, both ways)"

# transfer FROM_NS TO_NS TCP4|TCP6 TO_ADDRESS PORT: 4 MiB of random data, then compared.
transfer() {
	local from=$1 to=$2 tcp=$3 addr=$4 port=$5 listener
	head -c $((4 << 20)) /dev/urandom >"$work/send"
	rm -f "$work/recv"
	ip netns exec "$to" socat -u "$tcp-LISTEN:$port,reuseaddr" "CREATE:$work/recv" &
	listener=$!
	for _ in $(seq 50); do
		ip netns exec "$to" ss -Htln "sport = :$port" | grep -q . && break
		sleep 0.1
	done
	if ! timeout 120 ip netns exec "$from" socat -u "OPEN:$work/send" "$tcp:$addr:$port,connect-timeout=10"; then
		kill "$listener" 2>/dev/null || true
		fail "socat $from -> $addr:$port failed"
	fi
	wait "$listener" || fail "the receiving socat ($to) failed"
	[[ $(sha256sum <"$work/send") == $(sha256sum <"$work/recv") ]] ||
		fail "the 4 MiB to $addr arrived altered ($(stat -c %s "$work/recv") bytes)"
}
ms() { local us=${EPOCHREALTIME//[.,]/}; echo $((us / 1000)); }
t0=$(ms)
transfer "$a" "$b" TCP4 10.71.0.2 5201
t1=$(ms)
transfer "$b" "$a" TCP6 "[fd71::1]" 5202
t2=$(ms)
ok "transfer (4 MiB kilotun -> kernel over IPv4 in $((t1 - t0)) ms, kernel -> kilotun over IPv6 in $((t2 - t1)) ms, sha256 equal)"

# --- wg show dump, side by side ---------------------------------------------------------------------
dump_a=$(wga show kvmwga dump)
dump_b=$(wgb show kvmwgb dump)
# Printed without the private keys.
for side in kilotun kernel; do
	echo "$side: wg show dump"
	[[ $side == kilotun ]] && dump=$dump_a || dump=$dump_b
	awk 'BEGIN { FS = OFS = "\t" } NR == 1 { $1 = "(private key)" } { print "  " $0 }' <<<"$dump"
done
# Interface line: private-key public-key listen-port fwmark. Peer line: public-key preshared-key
# endpoint allowed-ips latest-handshake rx-bytes tx-bytes persistent-keepalive.
IFS=$'\t' read -r _ a_pub a_port a_fwmark <<<"$(head -n1 <<<"$dump_a")"
IFS=$'\t' read -r _ b_pub b_port b_fwmark <<<"$(head -n1 <<<"$dump_b")"
((  $(wc -l <<<"$dump_a") == 2 && $(wc -l <<<"$dump_b") == 2 )) || fail "each end should list one peer"
IFS=$'\t' read -r ap_key ap_psk ap_endpoint ap_allowed ap_hs ap_rx ap_tx ap_ka <<<"$(tail -n1 <<<"$dump_a")"
IFS=$'\t' read -r bp_key bp_psk bp_endpoint bp_allowed bp_hs bp_rx bp_tx bp_ka <<<"$(tail -n1 <<<"$dump_b")"
[[ $a_pub == "$pub_a" && $b_pub == "$pub_b" ]] || fail "public keys: kilotun $a_pub, kernel $b_pub"
[[ $ap_key == "$b_pub" && $bp_key == "$a_pub" ]] || fail "peer keys: kilotun has $ap_key, kernel has $bp_key"
[[ $a_port == 51820 && $b_port == 51821 ]] || fail "listen ports: kilotun $a_port, kernel $b_port"
[[ $a_fwmark == "$b_fwmark" ]] || fail "fwmark printed differently: kilotun $a_fwmark, kernel $b_fwmark"
[[ $ap_psk == "$bp_psk" ]] || fail "preshared key printed differently: kilotun $ap_psk, kernel $bp_psk"
[[ $ap_endpoint == 192.168.210.2:51821 && $bp_endpoint == 192.168.210.1:51820 ]] ||
	fail "endpoints: kilotun has $ap_endpoint, kernel has $bp_endpoint"
[[ $ap_allowed == 10.71.0.2/32,fd71::2/128 && $bp_allowed == 10.71.0.1/32,fd71::1/128 ]] ||
	fail "allowed IPs: kilotun has $ap_allowed, kernel has $bp_allowed"
[[ $ap_ka == "$bp_ka" ]] || fail "persistent keepalive printed differently: kilotun $ap_ka, kernel $bp_ka"
((ap_hs > 0 && bp_hs > 0 && (ap_hs - bp_hs <= 30) && (bp_hs - ap_hs <= 30))) ||
	fail "latest handshakes: kilotun $ap_hs, kernel $bp_hs"
# within PERCENT of each other.
close() { (($1 > 0 && $2 > 0 && ($1 - $2) * 100 <= $3 * $2 && ($2 - $1) * 100 <= $3 * $2)); }
close "$ap_tx" "$bp_rx" 2 || fail "kilotun sent $ap_tx bytes, the kernel received $bp_rx"
close "$bp_tx" "$ap_rx" 2 || fail "the kernel sent $bp_tx bytes, kilotun received $ap_rx"
ok "dump (keys, ports, endpoints, allowed IPs alike; kilotun tx $ap_tx / kernel rx $bp_rx, kernel tx $bp_tx / kilotun rx $ap_rx)"

# --- roaming, both ways ---------------------------------------------------------------------------
# endpoint_of NS DEVICE KEY: the endpoint that end has for the peer ("(none)": none).
endpoint_of() {
	local out
	out=$(ip netns exec "$1" wg show "$2" endpoints) || fail "wg show $2 endpoints in $1"
	awk -v k="$3" '$1 == k { print $2 }' <<<"$out"
}
# ping_ok NS TARGET: three answers out of three (after the first has come).
ping_ok() {
	local out
	ping_until "$1" "$2" || fail "ping $2 from $1: no answer in 10 s"
	out=$(ip netns exec "$1" ping -n -c 3 -i 0.2 -W 2 "$2" 2>&1) || fail "ping $2 from $1: $out"
}
# roam WHO a|b NEW MOVE...: the end (a: kilotun, b: the kernel) runs MOVE... to send from NEW
# (address:port) from then on. The other end's configuration stays as it is: it has the old
# endpoint before the move, and must have NEW after the moved end's first ping, from the source of
# its authenticated packets; then it pings back (to NEW).
roam() {
	local who=$1 mover=$2 new=$3 from ns dev key old to_ip back_ip seen
	shift 3
	if [[ $mover == a ]]; then
		from=$a ns=$b dev=kvmwgb key=$pub_a old=$ep_a to_ip=10.71.0.2 back_ip=10.71.0.1
	else
		from=$b ns=$a dev=kvmwga key=$pub_b old=$ep_b to_ip=10.71.0.1 back_ip=10.71.0.2
	fi
	seen=$(endpoint_of "$ns" "$dev" "$key")
	[[ $seen == "$old" ]] || fail "roaming ($who): before the move the other end has endpoint $seen, not $old"
	"$@"
	ping_until "$from" "$to_ip" || fail "roaming ($who): no answer to its ping in 10 s"
	seen=$(endpoint_of "$ns" "$dev" "$key")
	[[ $seen == "$new" ]] || fail "roaming ($who): after its ping the other end has endpoint $seen, not $new"
	ping_ok "$ns" "$back_ip"
	if [[ $mover == a ]]; then ep_a=$new; else ep_b=$new; fi
}
# new_port NS DEVICE PORT
new_port() {
	local now
	ip netns exec "$1" wg set "$2" listen-port "$3"
	now=$(ip netns exec "$1" wg show "$2" listen-port)
	[[ $now == "$3" ]] || fail "$2's listen port is $now after setting it to $3"
}
# new_address NS LINK OLD NEW: the link's address (a /24) replaced, the old one gone first.
new_address() {
	ip -n "$1" addr del "$3/24" dev "$2"
	ip -n "$1" addr add "$4/24" dev "$2"
}
t0=$(ms)
roam "kilotun's port" a 192.168.210.1:51830 new_port "$a" kvmwga 51830
roam "the kernel's port" b 192.168.210.2:51831 new_port "$b" kvmwgb 51831
roam "kilotun's address" a 192.168.210.11:51830 new_address "$a" kvmva 192.168.210.1 192.168.210.11
roam "the kernel's address" b 192.168.210.12:51831 new_address "$b" kvmvb 192.168.210.2 192.168.210.12
ok "roaming (kilotun to :51830 then 192.168.210.11, the kernel to :51831 then 192.168.210.12: each learnt from the other's packets; pings both ways; $(($(ms) - t0)) ms)"

# --- a peer removed and added again, on each end -----------------------------------------------------
# no_ping NS TARGET: no answer at all (two tries).
no_ping() { ! ip netns exec "$1" ping -n -c 2 -i 0.5 -W 1 "$2" >/dev/null 2>&1; }
# readded WHO NS DEVICE KEY ADD_FN: removes the peer KEY from DEVICE (in NS), checks that no ping
# passes either way, adds it again with ADD_FN (same allowed IPs, the endpoint it had) and
# checks that a new handshake (later than the last one, on both ends) lets pings through.
readded() {
	local who=$1 ns=$2 dev=$3 key=$4 add=$5 other other_ip own_ip before hs_a hs_b peers
	if [[ $ns == "$a" ]]; then other=$b other_ip=10.71.0.2 own_ip=10.71.0.1; else other=$a other_ip=10.71.0.1 own_ip=10.71.0.2; fi
	before=$(handshake_of "$a" kvmwga "$pub_b")
	hs_b=$(handshake_of "$b" kvmwgb "$pub_a")
	((hs_b > before)) && before=$hs_b
	((before > 0)) || fail "peer re-added ($who): no handshake before the removal"
	ip netns exec "$ns" wg set "$dev" peer "$key" remove
	peers=$(ip netns exec "$ns" wg show "$dev" peers)
	[[ -z $peers ]] || fail "peer re-added ($who): $dev still lists $peers after the removal"
	no_ping "$ns" "$other_ip" || fail "peer re-added ($who): a ping from it passed with its peer removed"
	no_ping "$other" "$own_ip" || fail "peer re-added ($who): a ping to it passed with its peer removed"
	# Handshake times are in seconds: let one go by so the new one is later.
	while (($(date +%s) <= before)); do sleep 0.2; done
	"$add"
	# Fresh: no handshake yet, or one made after the add (the other end still holds its session
	# and retries its handshake every 5 s; on a slow machine one can land before this check),
	# never the removed peer's.
	local fresh
	fresh=$(handshake_of "$ns" "$dev" "$key")
	((fresh == 0 || fresh > before)) || fail "peer re-added ($who): the new peer carries the removed one's handshake ($fresh, not after $before)"
	# The end with the fresh peer has no session: its packet makes it start a handshake.
	ping_ok "$ns" "$other_ip"
	ping_ok "$other" "$own_ip"
	hs_a=$(handshake_of "$a" kvmwga "$pub_b")
	hs_b=$(handshake_of "$b" kvmwgb "$pub_a")
	((hs_a > before && hs_b > before)) ||
		fail "peer re-added ($who): latest handshakes kilotun $hs_a, kernel $hs_b, not after $before"
	readded_hs="$before -> kilotun $hs_a, kernel $hs_b"
}
t0=$(ms)
readded kernel "$b" kvmwgb "$pub_a" add_peer_b
done_kernel=$readded_hs
readded kilotun "$a" kvmwga "$pub_b" add_peer_a
ok "peer-readd (removed on the kernel: no ping passes; added again, handshake $done_kernel; then on kilotun: $readded_hs; $(($(ms) - t0)) ms)"

kill "$kilotun_pid"
wait "$kilotun_pid" 2>/dev/null || true
kilotun_pid=
# How kilotun opened its TUN device on this kernel (offload or not), from its log.
echo "kilotun: $(sed 's/\x1b\[[0-9;]*m//g' "$work/kilotun.log" | grep -m1 -o 'TUN device .*' || echo '(no TUN line in its log)')"
echo "KVM_INTEROP_PASS kernel=$(uname -r)"
