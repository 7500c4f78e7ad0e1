#!/usr/bin/env bash
# End-to-end throughput through a WireGuard tunnel between two network namespaces over veth, both
# ends the same engine: kilotun and the engines users run instead, all measured in one run on the
# same machine. Each round measures every engine in turn (the engines alternate, so a change in
# the machine's load reaches all of them; each round starts with the next engine); the table
# gives each figure's median over the rounds, every round's value, and kilotun's ratio to it.
#
# Usage (as root): bench/throughput.sh [seconds per TCP run, default 10] [rounds, default 3]
# TCP_ONLY=1 measures only the four TCP figures (no ping, no UDP): for comparing builds over
# many rounds, where the per-round ratios below say more than any one round; STREAMS="1" (or
# "4") with it measures only those TCP runs, DIRECTIONS="fwd" (or "rev") only that direction.
#
# Engines: kilotun (built here in release mode, in ${CARGO_TARGET_DIR:-target}); wireguard-go
# 0.0.20260522 (Debian sid, the newest release), wireguard-go 0.0.20231211 (Debian
# bookworm-backports) and gotatun 0.10.2, fetched and cached by
# scripts/engines.sh on first use (gotatun is compiled: minutes); wireguard-go on PATH (Debian
# bookworm's 0.0.20220316), when there is one; boringtun-cli when BORINGTUN_CLI=/path/to/it is set
# (`scripts/engines.sh boringtun-cli` fetches 0.7.1 and prints its path); other kilotun builds
# (say, of the commit before a change) with KILOTUN_BUILDS="NAME=/path/to/kilotun …", each as
# engine kilotun-NAME. ENGINES="kilotun kilotun-NAME …" measures only the engines it names
# (kilotun, built here, always: the ratios are to it).
# Needs: iperf3, wireguard-tools, iproute2, python3.
#
# Per engine and round: iperf3 TCP with 1 and 4 streams, forward (a -> b) and reverse (-R), with
# the CPU seconds per GB carried (the machine's, and the engines' own), and each engine's peak
# RSS after them; ping RTT through the idle tunnel (average of 20); and UDP from udp-load twice,
# one datagram per message (sendmmsg/recvmmsg) and QUIC-style (UDP_SEGMENT/UDP_GRO): the
# highest rate sent with loss under 1%, up a fixed ladder of offered rates; once per run, what
# udp-load sends over the bare veth with no tunnel, the ceiling of those figures.
#
# OVERLAY=vxlan measures the overlay case instead: a VXLAN pair (VNI 42, UDP port 4789) between
# the two namespaces whose underlay is the WireGuard tunnel, as Cilium in tunnel mode and
# flannel's VXLAN backend send across Kilo's links, and the TCP runs go inside it (MTU 1370: the
# tunnel's 1420 less VXLAN's 50 bytes). The kernel segments the overlay's TCP before the tunnel
# device sees it, so each engine reads one ~1,420-byte UDP packet per packet. OVERLAY=geneve
# does the same over Geneve where the kernel has it (this script says so and stops where not).
# The overlay runs TCP only (TCP_ONLY is implied).
set -euo pipefail

secs=${1:-10}
rounds=${2:-3}
overlay=${OVERLAY:-}
case "$overlay" in
  "" | vxlan | geneve) ;;
  *) echo "throughput.sh: OVERLAY=$overlay: not an overlay this bench knows (vxlan, geneve)" >&2; exit 1 ;;
esac
for dir in ${DIRECTIONS:-fwd rev}; do
  case "$dir" in
    fwd | rev) ;;
    *) echo "throughput.sh: DIRECTIONS=$DIRECTIONS: $dir is not fwd or rev" >&2; exit 1 ;;
  esac
done
root=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "throughput.sh: run as root (network namespaces)" >&2; exit 1; }
for tool in iperf3 wg ip python3; do
  command -v "$tool" >/dev/null || { echo "throughput.sh: $tool is missing" >&2; exit 1; }
done
(cd "$root" && cargo build --release --quiet --bin kilotun && cargo build --release --quiet -p kilotun-bench --bin udp-load)
target=${CARGO_TARGET_DIR:-target}
case "$target" in /*) ;; *) target="$root/$target" ;; esac
kilotun="$target/release/kilotun"
udp_load="$target/release/udp-load"

# wanted ENGINE: whether ENGINES (default: every engine) names ENGINE.
wanted() {
  [ -z "${ENGINES:-}" ] && return 0
  case " $ENGINES " in *" $1 "*) return 0 ;; esac
  return 1
}

# KILOTUN_WIREGUARD_GO_2026=…, KILOTUN_WIREGUARD_GO_2023=… and KILOTUN_GOTATUN=…
if wanted wireguard-go-2026 || wanted wireguard-go-2023 || wanted gotatun; then
  engine_paths=$("$root/scripts/engines.sh" wireguard-go-2026 wireguard-go-2023 gotatun)
  while IFS='=' read -r name path; do
    case "$name" in
      KILOTUN_WIREGUARD_GO_2026) wireguard_go_2026=$path ;;
      KILOTUN_WIREGUARD_GO_2023) wireguard_go_2023=$path ;;
      KILOTUN_GOTATUN) gotatun=$path ;;
    esac
  done <<<"$engine_paths"
fi

# Engines in the order each round measures them, and their labels (with versions).
engines=(kilotun wireguard-go-2026 wireguard-go-2023 gotatun)
declare -A label=(
  [kilotun]=kilotun
  [wireguard-go-2026]="wireguard-go 0.0.20260522"
  [wireguard-go-2023]="wireguard-go 0.0.20231211"
  [gotatun]="gotatun 0.10.2"
)
declare -A build=()
for spec in ${KILOTUN_BUILDS:-}; do
  engines+=("kilotun-${spec%%=*}")
  label["kilotun-${spec%%=*}"]="kilotun-${spec%%=*}"
  build["kilotun-${spec%%=*}"]=${spec#*=}
done
if command -v wireguard-go >/dev/null; then
  engines+=(wireguard-go)
  label[wireguard-go]="wireguard-go $(wireguard-go --version | awk 'NR == 1 { sub(/^v/, "", $2); print $2 }')"
fi
if [ -n "${BORINGTUN_CLI:-}" ]; then
  engines+=(boringtun-cli)
  label[boringtun-cli]="boringtun-cli $("$BORINGTUN_CLI" --version | awk '{ print $2 }')"
fi
selected=()
for engine in "${engines[@]}"; do
  if [ "$engine" = kilotun ] || wanted "$engine"; then selected+=("$engine"); fi
done
engines=("${selected[@]}")

tag="tp$$"
nsa="${tag}a"; nsb="${tag}b"
work=$(mktemp -d)
cleanup() {
  for ns in "$nsa" "$nsb"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  sleep 0.3
  ip netns del "$nsa" 2>/dev/null || true
  ip netns del "$nsb" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

setup_underlay() {
  ip netns add "$nsa"; ip netns add "$nsb"
  ip link add "${tag}va" type veth peer name "${tag}vb"
  ip link set "${tag}va" netns "$nsa"; ip link set "${tag}vb" netns "$nsb"
  ip -n "$nsa" addr add 192.168.210.1/24 dev "${tag}va"
  ip -n "$nsb" addr add 192.168.210.2/24 dev "${tag}vb"
  for ns in "$nsa" "$nsb"; do ip -n "$ns" link set lo up; done
  ip -n "$nsa" link set "${tag}va" up; ip -n "$nsb" link set "${tag}vb" up
  wg genkey > "$work/ka"; wg genkey > "$work/kb"
}

# start ENGINE NS IFACE: starts ENGINE's daemon for IFACE in NS and waits for its UAPI socket.
start() {
  case "$1" in
    kilotun) ip netns exec "$2" "$kilotun" "$3" ;;
    kilotun-*) ip netns exec "$2" "${build[$1]}" "$3" ;;
    wireguard-go) ip netns exec "$2" wireguard-go "$3" ;;
    wireguard-go-2026) ip netns exec "$2" "$wireguard_go_2026" "$3" ;;
    wireguard-go-2023) ip netns exec "$2" "$wireguard_go_2023" "$3" ;;
    gotatun) ip netns exec "$2" "$gotatun" --disable-drop-privileges --log "$work/$3.log" "$3" >/dev/null ;;
    boringtun-cli) ip netns exec "$2" env WG_SUDO=1 "$BORINGTUN_CLI" --disable-drop-privileges "$3" ;;
  esac
  for _ in $(seq 100); do [ -S "/var/run/wireguard/$3.sock" ] && return 0; sleep 0.05; done
  echo "throughput.sh: $1 did not start" >&2; exit 1
}

# tunnel ENGINE: both ends run ENGINE; returns once a ping has crossed.
tunnel() {
  local engine=$1 ia="${tag}wa" ib="${tag}wb"
  start "$engine" "$nsa" "$ia"; start "$engine" "$nsb" "$ib"
  ip netns exec "$nsa" wg set "$ia" private-key "$work/ka" listen-port 51820 \
    peer "$(wg pubkey < "$work/kb")" allowed-ips 10.80.0.2/32 endpoint 192.168.210.2:51820
  ip netns exec "$nsb" wg set "$ib" private-key "$work/kb" listen-port 51820 \
    peer "$(wg pubkey < "$work/ka")" allowed-ips 10.80.0.1/32 endpoint 192.168.210.1:51820
  ip -n "$nsa" addr add 10.80.0.1/24 dev "$ia"; ip -n "$nsa" link set "$ia" up
  ip -n "$nsb" addr add 10.80.0.2/24 dev "$ib"; ip -n "$nsb" link set "$ib" up
  ip netns exec "$nsa" ping -c 1 -W 5 10.80.0.2 >/dev/null
  [ -n "$overlay" ] && overlay_up "$ia" "$ib"
  return 0
}

# overlay_up IFACE_A IFACE_B: the overlay pair over the tunnel (addresses 10.81.0.1 and
# 10.81.0.2, the iperf3 target); returns once a ping has crossed it.
overlay_up() {
  local oa="${tag}oa" ob="${tag}ob"
  if [ "$overlay" = vxlan ]; then
    ip -n "$nsa" link add "$oa" type vxlan id 42 dstport 4789 local 10.80.0.1 remote 10.80.0.2 dev "$1"
    ip -n "$nsb" link add "$ob" type vxlan id 42 dstport 4789 local 10.80.0.2 remote 10.80.0.1 dev "$2"
  else
    ip -n "$nsa" link add "$oa" type geneve id 42 remote 10.80.0.2
    ip -n "$nsb" link add "$ob" type geneve id 42 remote 10.80.0.1
  fi
  ip -n "$nsa" link set "$oa" mtu 1370 up; ip -n "$nsb" link set "$ob" mtu 1370 up
  ip -n "$nsa" addr add 10.81.0.1/24 dev "$oa"; ip -n "$nsb" addr add 10.81.0.2/24 dev "$ob"
  ip netns exec "$nsa" ping -c 1 -W 5 10.81.0.2 >/dev/null
}

# Stops both daemons and waits until they are gone, so the next engine can take the same
# interface names; a UAPI socket left behind would pass for the next daemon's.
teardown_tunnel() {
  for ns in "$nsa" "$nsb"; do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
  done
  for _ in $(seq 100); do
    [ -z "$(ip netns pids "$nsa")$(ip netns pids "$nsb")" ] && break
    sleep 0.05
  done
  rm -f "/var/run/wireguard/${tag}wa.sock" "/var/run/wireguard/${tag}wb.sock"
  # A VXLAN link goes with its tunnel device; a Geneve link (bound to no device) stays.
  ip -n "$nsa" link del "${tag}oa" 2>/dev/null || true
  ip -n "$nsb" link del "${tag}ob" 2>/dev/null || true
  sleep 0.5
}

# busy_ticks: CPU time the machine spent busy so far (user, nice, system, irq, softirq), in ticks.
busy_ticks() {
  awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 }' /proc/stat
}

# engine_ticks PID…: CPU time of the processes PID… so far, in ticks.
engine_ticks() {
  local pid total=0
  for pid in "$@"; do
    total=$((total + $(awk '{ print $14 + $15 }' "/proc/$pid/stat" 2>/dev/null || echo 0)))
  done
  echo "$total"
}

# iperf STREAMS DIRECTION(fwd|rev) -> "MBIT_S MACHINE_S_PER_GB ENGINES_S_PER_GB": the rate, and
# the CPU seconds per GB carried of the whole machine (iperf3 and kernel included) and of the
# two engines' processes (which include the kernel work done in their threads: the receiving
# TCP stack runs in the softirq of the thread writing the TUN device). CPU per GB is steadier
# than the rate on a shared machine and says where a faster engine could still gain.
iperf() {
  local flags=(-c "$target_address" -t "$secs" -P "$1" -J) busy0 engine0 json pids
  [ "$2" = rev ] && flags+=(-R)
  # The engines' daemons: all that runs in the namespaces before iperf3 starts.
  mapfile -t pids < <(ip netns pids "$nsa"; ip netns pids "$nsb")
  engine0=$(engine_ticks "${pids[@]}")
  ip netns exec "$nsb" iperf3 -s -1 -D >/dev/null 2>&1
  sleep 0.3
  busy0=$(busy_ticks)
  json=$(ip netns exec "$nsa" iperf3 "${flags[@]}" 2>/dev/null)
  python3 -c '
import json, os, sys
end = json.loads(sys.argv[1])["end"]["sum_received"]
hz = os.sysconf("SC_CLK_TCK")
gb = end["bytes"] / 1e9
busy = (int(sys.argv[3]) - int(sys.argv[2])) / hz
engines = (int(sys.argv[5]) - int(sys.argv[4])) / hz
print(round(end["bits_per_second"] / 1e6), round(busy / gb, 3), round(engines / gb, 3))
' "$json" "$busy0" "$(busy_ticks)" "$engine0" "$(engine_ticks "${pids[@]}")"
}

# udp_probe ADDRESS RATE [gso] -> "LOSS SENT": 3 s of 1300-byte datagrams (they fit the tunnel's
# MTU) offered at RATE Mbit/s by udp-load (bench/src/bin/udp-load.rs), which sends and receives
# with sendmmsg/recvmmsg: iperf3 moves one datagram per syscall and on this kind of machine cannot
# offer more than about 1.5 Gbit/s even with no tunnel. With gso, sender and receiver batch the
# way QUIC stacks do (UDP_SEGMENT runs of up to 50 datagrams, UDP_GRO). LOSS is in percent of
# what was sent, SENT is the rate actually sent (Mbit/s; the sender waits when the path cannot
# take more).
udp_probe() {
  local received sent send_flags=() recv_flags=()
  if [ "${3:-}" = gso ]; then send_flags=(--gso); recv_flags=(--gro); fi
  ip netns exec "$nsb" "$udp_load" recv "${recv_flags[@]}" 5201 3 >"$work/udp-received" &
  sleep 0.3
  sent=$(ip netns exec "$nsa" "$udp_load" send "${send_flags[@]}" "$1:5201" "$2" 3 1300 | awk '{print $3}')
  wait
  received=$(awk '{print $3}' "$work/udp-received")
  python3 -c "import sys; s, r = int(sys.argv[1] or 0), int(sys.argv[2] or 0); print(100 * (s - r) / s if s else 100, round(s * 8 / 3 / 1e6))" "$sent" "$received"
}

# udp_sustained [gso] -> "SENT LOSS OFFERED": the highest UDP rate sent through the tunnel
# (Mbit/s) with loss under 1%, climbing a fixed ladder of offered rates; it stops at the first
# step with 1% loss or more, or where the sender could not reach 90% of the offered rate (the
# path takes no more).
udp_sustained() {
  local best=0 best_loss=- best_offered=0 rate loss sent
  for rate in 250 500 750 1000 1250 1500 2000 2500 3000 4000 5000 6000; do
    read -r loss sent < <(udp_probe 10.80.0.2 "$rate" "${1:-}")
    if python3 -c "import sys; sys.exit(0 if $loss < 1 else 1)"; then
      best=$sent; best_loss=$(printf '%.2f' "$loss"); best_offered=$rate
    else
      break
    fi
    python3 -c "import sys; sys.exit(0 if $sent >= 0.9 * $rate else 1)" || break
  done
  echo "$best $best_loss $best_offered"
}

# peak_rss -> MIB: the larger of the two engines' peak resident memory so far (VmHWM), in MiB:
# after the TCP runs, an engine's memory with one peer at full rate.
peak_rss() {
  local pid kib max=0
  for pid in $(ip netns pids "$nsa"; ip netns pids "$nsb"); do
    kib=$(awk '/^VmHWM:/ { print $2 }' "/proc/$pid/status" 2>/dev/null || echo 0)
    [ "${kib:-0}" -gt "$max" ] && max=$kib
  done
  python3 -c "import sys; print(round(int(sys.argv[1]) / 1024, 1))" "$max"
}

rtt() {
  ip netns exec "$nsa" ping -q -c 20 -i 0.05 10.80.0.2 | awk -F/ '/rtt/ {print $5}'
}

# Results, one line each: ENGINE ROUND METRIC VALUE [LOSS]; METRIC is STREAMS-DIRECTION, rtt or udp.
results="$work/results"
: >"$results"
setup_underlay
tcp_only=${TCP_ONLY:-0}
target_address=10.80.0.2
if [ -n "$overlay" ]; then
  # Whether this kernel has the overlay's link type at all (Geneve is often left out).
  if ! ip -n "$nsa" link add "${tag}probe" type "$overlay" id 1 remote 10.80.0.2 dstport 6081 2>/dev/null; then
    echo "throughput.sh: OVERLAY=$overlay: this kernel ($(uname -r)) has no $overlay link type" >&2
    exit 2
  fi
  ip -n "$nsa" link del "${tag}probe"
  tcp_only=1 target_address=10.81.0.2
fi
bare_loss=- bare_sent=- bare_gso_loss=- bare_gso_sent=-
if [ "$tcp_only" = 0 ]; then
  # What udp-load can send over the bare veth, no tunnel: the ceiling of the UDP figures.
  read -r bare_loss bare_sent < <(udp_probe 192.168.210.2 5000)
  read -r bare_gso_loss bare_gso_sent < <(udp_probe 192.168.210.2 8000 gso)
fi
for round in $(seq "$rounds"); do
  # Each round starts with the next engine, so that none is always first (after the idle
  # pause of the round's start) or always last.
  shift_by=$(((round - 1) % ${#engines[@]}))
  for engine in "${engines[@]:shift_by}" "${engines[@]:0:shift_by}"; do
    echo "throughput.sh: round $round of $rounds, ${label[$engine]}" >&2
    tunnel "$engine"
    for streams in ${STREAMS:-1 4}; do
      for dir in ${DIRECTIONS:-fwd rev}; do
        echo "$engine $round $streams-$dir $(iperf "$streams" "$dir")" >>"$results"
      done
    done
    echo "$engine $round peak-rss $(peak_rss)" >>"$results"
    if [ "$tcp_only" = 0 ]; then
      echo "$engine $round rtt $(rtt)" >>"$results"
      echo "$engine $round udp $(udp_sustained)" >>"$results"
      echo "$engine $round udp-gso $(udp_sustained gso)" >>"$results"
    fi
    teardown_tunnel
  done
done

labels=$(for engine in "${engines[@]}"; do printf '%s=%s\n' "$engine" "${label[$engine]}"; done)
echo "# $(date -u +%F) $(nproc) cores, $(uname -r), iperf3 TCP $secs s per run, $rounds rounds" \
  "${overlay:+inside a $overlay overlay over the tunnel }(engines alternate within each round), medians over the rounds"
python3 - "$results" "$labels" "$bare_sent" "$bare_loss" "$bare_gso_sent" "$bare_gso_loss" <<'EOF'
import math, random, statistics, sys

results, labels, bare_sent, bare_loss, bare_gso_sent, bare_gso_loss = sys.argv[1:7]
label = dict(line.split("=", 1) for line in labels.splitlines())
engines = list(label)
values = {}
rounds_run = len({line.split()[1] for line in open(results)})
for line in open(results):
    engine, _round, metric, *rest = line.split()
    values.setdefault((engine, metric), []).append(rest)
# The TCP runs made (STREAMS may leave some out).
tcp = tuple(m for m in ("1-fwd", "1-rev", "4-fwd", "4-rev") if ("kilotun", m) in values)


def median(engine, metric):
    return statistics.median(float(v[0]) for v in values[(engine, metric)])


def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"


width = max(len(l) for l in label.values())
print(f"{'engine':<{width}}  streams  direction  {'Mbit/s':>7}  {'kilotun ratio':>13}  rounds")
for metric in tcp:
    streams, direction = metric.split("-")
    k = median("kilotun", metric)
    for engine in engines:
        m = median(engine, metric)
        runs = " ".join(v[0] for v in values[(engine, metric)])
        r = "" if engine == "kilotun" else ratio(k, m)
        print(f"{label[engine]:<{width}}  {streams:>7}  {direction:<9}  {m:>7.0f}  {r:>13}  {runs}")

print()
print("CPU seconds per GB carried, medians over the rounds: the whole machine / the two engines:")
print(f"  {'engine':<{width}}" + "".join(f"  {m.replace('-', ' '):>13}" for m in tcp))
for engine in engines:
    cells = []
    for metric in tcp:
        runs = [v for v in values[(engine, metric)] if len(v) >= 3]
        machine = statistics.median(float(v[1]) for v in runs) if runs else float("nan")
        own = statistics.median(float(v[2]) for v in runs) if runs else float("nan")
        cells.append(f"{machine:.2f} / {own:.2f}")
    print(f"  {label[engine]:<{width}}" + "".join(f"  {c:>13}" for c in cells))


def own_cpu(engine, metric):
    runs = [float(v[2]) for v in values[(engine, metric)] if len(v) >= 3]
    return statistics.median(runs) if runs else 0


print("each engine's own CPU per GB as a multiple of kilotun's:")
for engine in engines[1:]:
    cells = [ratio(own_cpu(engine, m), own_cpu("kilotun", m)) for m in tcp]
    print(f"  {label[engine]:<{width}}" + "".join(f"  {c:>13}" for c in cells))

print()
print("peak resident memory of one engine after the TCP runs (MiB, VmHWM), median over the rounds:")
for engine in engines:
    runs = " ".join(v[0] for v in values[(engine, "peak-rss")])
    print(f"  {label[engine]:<{width}}  {median(engine, 'peak-rss'):.1f}  (rounds: {runs})")

tcp_only = ("kilotun", "rtt") not in values
if not tcp_only:
    print()
    print("ping RTT through the idle tunnel, average of 20 pings (ms), median over the rounds:")
    for engine in engines:
        runs = " ".join(v[0] for v in values[(engine, "rtt")])
        print(f"  {label[engine]:<{width}}  {median(engine, 'rtt'):.3f}  (rounds: {runs})")

    for metric, title, sent, loss, offered in (
        ("udp", "one datagram per message (sendmmsg/recvmmsg)", bare_sent, bare_loss, 5000),
        ("udp-gso", "QUIC-style sender and receiver (UDP_SEGMENT/UDP_GRO)", bare_gso_sent, bare_gso_loss, 8000),
    ):
        print()
        print(f"UDP, {title}: highest rate sent (Mbit/s) with loss under 1%, median over the rounds:")
        k = median("kilotun", metric)
        for engine in engines:
            m = median(engine, metric)
            runs = " ".join(f"{v[0]} ({v[1]}%, {v[2]} offered)" for v in values[(engine, metric)])
            r = "" if engine == "kilotun" else f"  kilotun ratio {ratio(k, m)}"
            print(f"  {label[engine]:<{width}}  {m:>5.0f}{r}  (rounds, with loss and the rate offered: {runs})")
        print(f"  no tunnel (the bare veth), {offered} offered: udp-load sent {sent} Mbit/s, loss {float(loss):.2f}%")

shown = tcp if tcp_only else tcp + ("udp", "udp-gso")
titles = {"udp": "UDP", "udp-gso": "UDP-GSO"}
print()
print("kilotun's ratio to each engine (medians):")
print(f"  {'engine':<{width}}" + "".join(f"  {titles.get(m, m.replace('-', ' ')):>5}" for m in shown))
for engine in engines[1:]:
    cells = [ratio(median("kilotun", m), median(engine, m)) for m in shown]
    print(f"  {label[engine]:<{width}}" + "".join(f"  {c:>5}" for c in cells))


# Round by round: each engine ran right after kilotun in the same round, so a ratio taken within
# a round cancels the machine's slower drifts. Their geometric mean, with a 95% interval from
# resampling the rounds (10,000 draws, fixed seed): a build within 3% of another shows as an
# interval inside 0.97 to 1.03, which single medians of noisy rounds cannot show.
def paired(engine, metric):
    mine = [float(v[0]) for v in values[("kilotun", metric)]]
    theirs = [float(v[0]) for v in values[(engine, metric)]]
    return [math.log(a / b) for a, b in zip(mine, theirs) if a > 0 and b > 0]


if rounds_run >= 3:
    draw = random.Random(35)
    print()
    print(f"kilotun's ratio round by round, geometric mean and 95% interval over {rounds_run} rounds:")
    print(f"  {'engine':<{width}}" + "".join(f"  {m.replace('-', ' '):>18}" for m in tcp))
    for engine in engines[1:]:
        cells = []
        for metric in tcp:
            logs = paired(engine, metric)
            means = sorted(
                statistics.fmean(draw.choices(logs, k=len(logs))) for _ in range(10_000)
            )
            low, high = means[250], means[9_749]
            cells.append(f"{math.exp(statistics.fmean(logs)):.3f} [{math.exp(low):.3f}-{math.exp(high):.3f}]")
        print(f"  {label[engine]:<{width}}" + "".join(f"  {c:>18}" for c in cells))
EOF
