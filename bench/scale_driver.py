"""Load for bench/scale.sh: N ready Kilo Nodes on a Kubernetes API server, their
check-in churn (each Node's kilo.squat.ai/last-seen patched every 30 s, so N/30 patches a
second), and the change-to-engine latency of a remote Node's location change.

    scale_driver.py create N            create N ready Nodes in SCALE_LOCATIONS locations (100
                                        by default), plus kg's own
    scale_driver.py churn N COUNTER     patch last-seen at N/30 a second until killed; the
                                        number of patches done is rewritten into COUNTER
    scale_driver.py podchurn N COUNTER  with SCALE_IPAM=pods, replace SCALE_POD_CHURN pods a second
                                        until killed; the pod watch events caused are
                                        rewritten into COUNTER
    scale_driver.py change N IFACE K WHAT
                                        make K changes of kind WHAT, one at a time, and print
                                        for each its latency until kg's engine (`wg show
                                        IFACE`) has it, in ms, and the Unix time in ms it was
                                        sent at. WHAT is one of:
                                          follower  a node that does not lead its location
                                                    moves to a new location (a new peer)
                                          leader    a location's leader moves to a new
                                                    location: that location's next node
                                                    becomes its peer and the mover a new one
                                          join      a new node joins an existing location (its
                                                    pod CIDR joins that location's peer)
                                          delete    a location's leader is deleted (the next
                                                    node of the location becomes its peer)
                                          block     with SCALE_IPAM=calico, a node takes one
                                                    more Calico block (its location's peer
                                                    gets it as an allowed IP)
                                          pod       with SCALE_IPAM=pods, a pod starts on a
                                                    node (its address joins its location's
                                                    peer)
    scale_driver.py stages LOG CHANGES  where each change's time went: the stages of kg's
                                        reconciles (its `kilotun::stages` debug lines in LOG)
                                        that started while the change was on its way, and
                                        the watch (the first one's start less the send time)

Environment: APISERVER_URL, ADMIN_TOKEN, KUBE_CA_FILE (scripts/kube-up.sh's env file).
KUBELET_STATUS=1 gives every created Node the status a kubelet reports (addresses, conditions,
node info, 50 images), so each watch event is about the size it is in a real cluster (the Node
as created is 12 kB of JSON instead of 0.4 kB, before the API server adds its metadata and
managed fields).
"""

import base64
import http.client
import json
import re
import statistics
import os
import random
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.parse

LOCATIONS = int(os.environ.get("SCALE_LOCATIONS", "100"))
LOCAL = "kg-bench"
# How the nodes' addresses are laid out (bench/scale.sh --layout):
#   apart     endpoints in 10.0.0.0/8, internal IPs in 172.16.0.0/16, IPv4 pods
#   internal  each endpoint the node's internal IP, all in one private network 172.16.0.0/12
#   wan       the same nodes as internal; kg's own node sits on another network (scale.sh)
#             (on-premises, one VPC)
#   ipv6      endpoints and internal IPs IPv6, IPv6 pods
#   dual      IPv4 endpoints, an IPv4 and an IPv6 internal IP, IPv4 and IPv6 pods
#   dns       endpoints as DNS names (node-N.scale.test, which bench/scale.sh's dnsmasq answers)
#   nat       endpoints private (10.200.0.0/16, unreachable), each node with a keepalive, and
#             the public address a leader found for it in another node's discovered-endpoints
#   candidates  the nodes of wan, each publishing three candidates in kilotun.io/endpoints:
#             its endpoint, a 10.0.0.0/8 one and a 100.64.0.0/10 one (black-holed by scale.sh)
LAYOUT = os.environ.get("SCALE_LAYOUT", "apart")
# The mesh granularity every node announces, as kg's --mesh-granularity (bench/scale.sh).
GRANULARITY = os.environ.get("SCALE_GRANULARITY", "location")
LAYOUTS = ("apart", "internal", "wan", "ipv6", "dual", "dns", "nat", "candidates")
# Where the pods live (bench/scale.sh --ipam): "node" (each Node's spec.podCIDR), "calico"
# (BLOCKS Calico BlockAffinity objects per node, /26 blocks out of 10.64.0.0/10; the Nodes'
# spec.podCIDR is then no pod's) or "pods" (the pods' own addresses, below).
IPAM = os.environ.get("SCALE_IPAM", "node")
BLOCKS = 4
AFFINITIES = "/apis/crd.projectcalico.org/v1/blockaffinities"
# With SCALE_IPAM=pods: SCALE_PODS pods per node (100 by default), running with addresses in the
# node's /24, in namespace POD_NAMESPACE; `podchurn` replaces SCALE_POD_CHURN of them a second
# (10 by default): deleted, created again, given an address (three watch events each).
PODS = int(os.environ.get("SCALE_PODS", "100"))
if not 1 <= PODS <= 126:
    raise SystemExit(f"SCALE_PODS={PODS}: from 1 to 126 (each generation of a node's pods takes "
                     "half of its /24)")
POD_NAMESPACE = "bench-pods"
PODS_PATH = f"/api/v1/namespaces/{POD_NAMESPACE}/pods"


def connection():
    url = urllib.parse.urlparse(os.environ["APISERVER_URL"])
    context = ssl.create_default_context(cafile=os.environ["KUBE_CA_FILE"])
    return http.client.HTTPSConnection(url.hostname, url.port, context=context, timeout=30)


def request(conn, method, path, body, content_type="application/json"):
    headers = {
        "Authorization": "Bearer " + os.environ["ADMIN_TOKEN"],
        "Content-Type": content_type,
    }
    conn.request(method, path, json.dumps(body), headers)
    answer = conn.getresponse()
    data = answer.read()
    if answer.status >= 300 and answer.status != 409:
        raise RuntimeError(f"{method} {path}: {answer.status} {data[:300]!r}")
    return answer.status


def key(i):
    return base64.b64encode(struct.pack("<Q", i + 1) + bytes(24)).decode()


def name(i):
    return f"n-{i:05d}"


def kubelet_status(i):
    """A status the size of a real kubelet's: addresses, capacity, conditions, node info and
    the 50 images kubelet reports at most."""
    stamp = "2026-01-01T00:00:00Z"
    conditions = [
        {"type": t, "status": "False", "reason": f"KubeletHasSufficient{t}",
         "message": f"kubelet has sufficient {t.lower()} available",
         "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
        for t in ("MemoryPressure", "DiskPressure", "PIDPressure")
    ] + [{"type": "Ready", "status": "True", "reason": "KubeletReady",
          "message": "kubelet is posting ready status", "lastHeartbeatTime": stamp,
          "lastTransitionTime": stamp}]
    images = [
        {"names": [f"registry.example.com/team-{k % 7}/image-{k}@sha256:{k:064x}",
                   f"registry.example.com/team-{k % 7}/image-{k}:v1.{k}.0"],
         "sizeBytes": 10_000_000 + k * 12345}
        for k in range(50)
    ]
    resources = {"cpu": "8", "memory": "32883400Ki", "pods": "110",
                 "ephemeral-storage": "101445540Ki", "hugepages-2Mi": "0"}
    return {
        "addresses": [{"type": "InternalIP", "address": f"172.16.{(i // 256) % 256}.{i % 256}"},
                      {"type": "Hostname", "address": name(i)}],
        "capacity": resources, "allocatable": resources, "conditions": conditions,
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "images": images,
        "nodeInfo": {"machineID": f"{i:032x}", "systemUUID": f"{i:032x}", "bootID": f"{i:032x}",
                     "kernelVersion": "5.10.0-28-amd64", "osImage": "Debian GNU/Linux 11",
                     "containerRuntimeVersion": "containerd://1.6.20",
                     "kubeletVersion": "v1.20.2", "kubeProxyVersion": "v1.20.2",
                     "operatingSystem": "linux", "architecture": "amd64"},
    }


def public_ip(i):
    return f"10.{1 + i // 65536}.{(i // 256) % 256}.{i % 256}"


def hosts(n):
    """The hosts-file lines that resolve the dns layout's endpoint names."""
    return "".join(f"{public_ip(i)} node-{i}.scale.test\n" for i in range(n))


def addresses(i):
    """Node i's Kilo annotations for its addresses, and its pod CIDRs, in LAYOUT."""
    hi, lo = (i // 256) % 256, i % 256
    v4_pods = [pod_cidr(i)]
    v6_pods = [f"fd42:{64 + i // 256:x}:{lo:x}::/64"]
    if LAYOUT == "apart":
        return {"endpoint": f"{public_ip(i)}:51820", "internal-ip": f"172.16.{hi}.{lo}/16"}, v4_pods
    if LAYOUT in ("internal", "wan"):
        return {"endpoint": f"172.16.{hi}.{lo}:51820", "internal-ip": f"172.16.{hi}.{lo}/12"}, v4_pods
    if LAYOUT == "candidates":
        listed = f"172.16.{hi}.{lo}:51820,{public_ip(i)}:51820,100.64.{hi}.{lo}:51820"
        return {"endpoint": f"172.16.{hi}.{lo}:51820", "internal-ip": f"172.16.{hi}.{lo}/12",
                "CANDIDATES": listed}, v4_pods
    if LAYOUT == "ipv6":
        return {"endpoint": f"[fd00:1::{i:x}]:51820", "internal-ip": f"fd00:172:16::{i:x}/64"}, v6_pods
    if LAYOUT == "dual":
        return {"endpoint": f"{public_ip(i)}:51820", "internal-ip": f"172.16.{hi}.{lo}/16",
                "SECOND-IP": f"fd00:172:16::{i:x}/64"}, v4_pods + v6_pods
    if LAYOUT == "dns":
        return {"endpoint": f"node-{i}.scale.test:51820", "internal-ip": f"172.16.{hi}.{lo}/16"}, v4_pods
    if LAYOUT == "nat":
        found = {}
        if i < LOCATIONS:
            # What this location's leader saw as a hub: the NAT routers of the next
            # location's nodes (an annotation holds at most 256 kB, so no node lists all).
            nxt = (i + 1) % LOCATIONS
            found = {"discovered-endpoints": json.dumps({
                key(j): {"IP": f"203.0.{(j // 256) % 256}.{j % 256}", "Port": 40000 + j % 20000,
                         "Zone": ""} for j in range(nxt, NODES, LOCATIONS)})}
        return found | {"endpoint": f"10.200.{hi}.{lo}:51820", "internal-ip": f"10.200.{hi}.{lo}/16",
                        "persistent-keepalive": "25"}, v4_pods
    raise SystemExit(f"SCALE_LAYOUT={LAYOUT}: one of {', '.join(LAYOUTS)}")


def annotation(short):
    if short == "CANDIDATES":
        return "kilotun.io/endpoints"
    return "kilotun.io/second-internal-ip" if short == "SECOND-IP" else f"kilo.squat.ai/{short}"


def node(i, now):
    extra = {"status": kubelet_status(i)} if os.environ.get("KUBELET_STATUS") == "1" else {}
    annotations, pods = addresses(i)
    return extra | {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name(i),
            "annotations": {annotation(k): v for k, v in annotations.items()} | {
                "kilo.squat.ai/key": key(i),
                "kilo.squat.ai/last-seen": str(now),
                "kilo.squat.ai/location": f"loc-{i % LOCATIONS:03d}",
                "kilo.squat.ai/granularity": GRANULARITY,
            },
        },
        "spec": {"podCIDR": pods[0], "podCIDRs": pods},
    }


def block(j):
    """Calico block number j: the j-th /26 of 10.64.0.0/10."""
    base = (10 << 24) | (64 << 16)
    addr = base + 64 * j
    return f"{addr >> 24}.{(addr >> 16) & 255}.{(addr >> 8) & 255}.{addr & 255}/26"


def affinity(node_name, cidr):
    return {
        "apiVersion": "crd.projectcalico.org/v1",
        "kind": "BlockAffinity",
        "metadata": {"name": f"{node_name}-{cidr.replace('.', '-').replace('/', '-')}"},
        "spec": {"node": node_name, "cidr": cidr, "state": "confirmed", "deleted": "false"},
    }


def pod_ip(i, p, generation=0):
    """The address of node i's pod p: in the node's /24, .2 to .101 and, in odd generations
    (a replaced pod), .130 to .229."""
    base = pod_cidr(i).rsplit(".", 1)[0]
    return f"{base}.{p + 2 + 128 * (generation % 2)}"


def pod_name(i, p):
    return f"p-{i:05d}-{p:03d}"


def run_pod(conn, i, p, ip, node_name=None):
    """Creates pod p of node i and writes the status a kubelet would (Running, its address)."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": pod_name(i, p)},
        "spec": {
            "nodeName": node_name or name(i),
            "automountServiceAccountToken": False,
            "containers": [{"name": "c", "image": "pause"}],
        },
    }
    request(conn, "POST", PODS_PATH, body)
    status = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}
    request(conn, "PATCH", f"{PODS_PATH}/{pod_name(i, p)}/status", status,
            "application/merge-patch+json")


def create_pods(n):
    conn = connection()
    request(conn, "POST", "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": POD_NAMESPACE}})
    # No controller manager here makes the namespace's default ServiceAccount, which the
    # ServiceAccount admission plugin wants for every pod.
    request(conn, "POST", f"/api/v1/namespaces/{POD_NAMESPACE}/serviceaccounts",
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})

    def worker(start, step):
        c = connection()
        for i in range(start, n, step):
            for p in range(PODS):
                run_pod(c, i, p, pod_ip(i, p))

    threads = [threading.Thread(target=worker, args=(s, 4)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run_pod(conn, 0, 999, "10.250.0.2", LOCAL)


def pod_churn(n, counter):
    """Replaces SCALE_POD_CHURN pods a second (each deleted, created again, given the address
    of its next generation) until killed; the watch events caused (three per pod) are
    rewritten into COUNTER."""
    rate = float(os.environ.get("SCALE_POD_CHURN", "10"))
    conn = connection()
    rng = random.Random(11)
    generation = {}
    events = 0
    start = time.monotonic()
    k = 0
    while True:
        delay = start + k / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        k += 1
        # Nodes past the first two of each location, which the changes move.
        i = rng.randrange(2 * LOCATIONS, n) if n > 2 * LOCATIONS else rng.randrange(n)
        p = rng.randrange(PODS)
        g = generation.get((i, p), 0) + 1
        generation[(i, p)] = g
        conn.request("DELETE", f"{PODS_PATH}/{pod_name(i, p)}?gracePeriodSeconds=0",
                     headers={"Authorization": "Bearer " + os.environ["ADMIN_TOKEN"]})
        conn.getresponse().read()
        run_pod(conn, i, p, pod_ip(i, p, g))
        events += 3
        with open(counter + ".tmp", "w") as f:
            f.write(f"{events}\n")
        os.replace(counter + ".tmp", counter)


def create(n):
    now = int(time.time())
    local = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": LOCAL,
            "annotations": {"kilo.squat.ai/location": "bench-local", "kilo.squat.ai/leader": ""},
        },
        "spec": {"podCIDR": "10.250.0.0/24"},
    }
    conn = connection()
    request(conn, "POST", "/api/v1/nodes", local)

    if IPAM == "calico":
        request(conn, "POST", AFFINITIES, affinity(LOCAL, "10.250.0.0/26"))

    def worker(start, step):
        c = connection()
        for i in range(start, n, step):
            request(c, "POST", "/api/v1/nodes", node(i, now))
            if IPAM == "calico":
                for b in range(BLOCKS):
                    request(c, "POST", AFFINITIES, affinity(name(i), block(BLOCKS * i + b)))

    threads = [threading.Thread(target=worker, args=(s, 4)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if IPAM == "pods":
        create_pods(n)


def patch_annotation(conn, i, key_name, value):
    body = {"metadata": {"annotations": {key_name: value}}}
    request(conn, "PATCH", f"/api/v1/nodes/{name(i)}", body, "application/merge-patch+json")


def flaps(i):
    """Whether node i may flap (SCALE_FLAP): not the first two nodes of a location, which the
    leader and delete changes move, nor the follower change's nodes (i % LOCATIONS == 7)."""
    return i >= 2 * LOCATIONS and i % LOCATIONS != 7


def churn(n, counter):
    rate = n / 30.0
    done = [0]
    lock = threading.Lock()
    threads = 4
    # SCALE_FLAP=F: a fraction F of the nodes crosses Kilo's 60 s last-seen bound every
    # minute. A node that flaps skips its check-ins for 75 s: past the bound from 60 s after
    # its last one until the next one it makes (90 s), then back.
    flap = float(os.environ.get("SCALE_FLAP", "0"))
    silent_until = {}
    chance = flap / 2  # two check-ins a minute per node
    rng = random.Random(7)

    def worker(w):
        c = connection()
        start = time.monotonic()
        k = 0
        while True:
            # Worker w patches nodes w, w+threads, ...: each node every 30 s in all.
            due = start + k * threads / rate
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            i = (w + k * threads) % n
            k += 1
            now = time.monotonic()
            if silent_until.get(i, 0) > now:
                continue
            if flap and flaps(i) and rng.random() < chance:
                silent_until[i] = now + 75
                continue
            patch_annotation(c, i, "kilo.squat.ai/last-seen", str(int(time.time())))
            with lock:
                done[0] += 1

    for w in range(threads):
        threading.Thread(target=worker, args=(w,), daemon=True).start()
    while True:
        time.sleep(0.5)
        with lock:
            count = done[0]
        with open(counter + ".tmp", "w") as f:
            f.write(f"{count}\n")
        os.replace(counter + ".tmp", counter)


def wg_show(iface, what):
    out = subprocess.run(["wg", "show", iface, what], capture_output=True, text=True)
    return out.stdout.split()


def pod_cidr(i):
    return f"10.{64 + i // 256}.{i % 256}.0/24"


def change(n, iface, count, what):
    """Makes `count` changes of kind `what` and prints each one's latency (ms) and send time
    (Unix ms). Node X < LOCATIONS leads location X (Kilo's rule picks the first name);
    node X + LOCATIONS is that location's next."""
    conn = connection()
    results = []
    if count > LOCATIONS:
        raise SystemExit(f"{what}: {count} changes need as many locations (there are {LOCATIONS})")
    used = set()
    for k in range(count):
        # Locations spread over the cluster, a different one for each change.
        x = (k * 37 + 11) % LOCATIONS
        while x in used:
            x = (x + 1) % LOCATIONS
        used.add(x)
        if what == "follower":
            i = LOCATIONS * (1 + k) + 7
            if i >= n:
                i = LOCATIONS + k
            wanted = lambda: key(i) in wg_show(iface, "peers")
            act = lambda: patch_annotation(conn, i, "kilo.squat.ai/location",
                                           f"moved-{k}-{int(time.time())}")
        elif what == "leader":
            if x + LOCATIONS >= n:
                raise SystemExit("leader: every location needs a second node")
            wanted = lambda: {key(x), key(x + LOCATIONS)} <= set(wg_show(iface, "peers"))
            act = lambda: patch_annotation(conn, x, "kilo.squat.ai/location",
                                           f"moved-{k}-{int(time.time())}")
        elif what == "join":
            i = n + k
            wanted = lambda: pod_cidr(i) in wg_show(iface, "allowed-ips")
            act = lambda: request(conn, "POST", "/api/v1/nodes", node(i, int(time.time())))
        elif what == "block":
            # A node of location x takes one more Calico block.
            cidr = block(BLOCKS * (n + LOCATIONS) + k)
            wanted = lambda: cidr in wg_show(iface, "allowed-ips")
            act = lambda: request(conn, "POST", AFFINITIES, affinity(name(x + LOCATIONS), cidr))
        elif what == "pod":
            # A pod starts on a node of location x, with an address outside every node's range.
            ip = f"10.251.{k // 250}.{k % 250 + 2}"
            wanted = lambda: f"{ip}/32" in wg_show(iface, "allowed-ips")
            act = lambda: run_pod(conn, x + LOCATIONS, 500 + k, ip)
        elif what == "delete":
            if x + LOCATIONS >= n:
                raise SystemExit("delete: every location needs a second node")

            def wanted():
                peers = set(wg_show(iface, "peers"))
                return key(x + LOCATIONS) in peers and key(x) not in peers

            act = lambda: request(conn, "DELETE", f"/api/v1/nodes/{name(x)}", {})
        else:
            raise SystemExit(f"unknown change {what!r}: follower, leader, join, delete, block or pod")
        sent_ms = int(time.time() * 1000)
        start = time.monotonic()
        act()
        while not wanted():
            if time.monotonic() - start > 30:
                raise RuntimeError(f"change {k} ({what}) never reached {iface}")
            time.sleep(0.005)
        results.append(((time.monotonic() - start) * 1000, sent_ms))
        time.sleep(2)
    for latency, sent in results:
        print(f"{latency:.1f} {sent}")


STAGES = ["translate", "host", "leases", "topology", "routes", "engine", "firewall", "wall"]


def stages(log, changes):
    """Prints, for the changes in file `changes` (lines "latency_ms sent_unix_ms"), the
    median and worst of the watch (from the send to the start of the first reconcile a watch
    event started after it) and of each stage summed over the event reconciles that started
    while the change was on its way to the engine. The firewall comes after the engine, so
    its time is not part of the latency; `wall` is the reconciles' whole time (DNS and the
    annotation patch included)."""
    field = re.compile(r"(\w+)=(\S+)")
    reconciles = []
    with open(log) as f:
        for line in f:
            if "reconcile stages" not in line:
                continue
            fields = dict(field.findall(line))
            if "started_unix_ms" in fields:
                reconciles.append(fields)
    per_change = []
    for line in open(changes):
        latency, sent = line.split()
        latency, sent = float(latency), int(sent)
        during = [r for r in reconciles
                  if r.get("trigger") == "Event"
                  and sent <= int(r["started_unix_ms"]) <= sent + latency]
        if not during:
            continue
        row = {"watch": int(during[0]["started_unix_ms"]) - sent, "reconciles": len(during)}
        for stage in STAGES:
            row[stage] = sum(float(r.get(f"{stage}_ms", "0")) for r in during)
        per_change.append(row)
    if not per_change:
        print("where the time went: no kilotun::stages line matched a change")
        return
    parts = []
    for what in ["watch"] + STAGES:
        values = [r[what] for r in per_change]
        parts.append(f"{what} {statistics.median(values):.1f}/{max(values):.1f}")
    counts = [r["reconciles"] for r in per_change]
    print(f"where the time went, ms median/worst over {len(per_change)} changes: "
          + ", ".join(parts) + f"; reconciles per change {statistics.median(counts):g}")


def main():
    what = sys.argv[1]
    if what == "stages":
        stages(sys.argv[2], sys.argv[3])
        return
    n = int(sys.argv[2])
    global NODES
    NODES = n
    if what == "hosts":
        sys.stdout.write(hosts(n))
    elif what == "create":
        create(n)
    elif what == "churn":
        churn(n, sys.argv[3])
    elif what == "podchurn":
        pod_churn(n, sys.argv[3])
    elif what == "change":
        change(n, sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
