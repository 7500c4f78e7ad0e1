"""Load for bench/scale.sh: N ready Kilo Nodes on a Kubernetes API server, their
check-in churn (each Node's kilo.squat.ai/last-seen patched every 30 s, so N/30 patches a
second), and the change-to-engine latency of a remote Node's location change.

    scale_driver.py create N            create N ready Nodes in 100 locations, plus kg's own
    scale_driver.py churn N COUNTER     patch last-seen at N/30 a second until killed; the
                                        number of patches done is rewritten into COUNTER
    scale_driver.py move N IFACE K      move K remote Nodes (one at a time) to new locations and
                                        print each one's latency until `wg show IFACE peers`
                                        lists it, in ms

Environment: APISERVER_URL, ADMIN_TOKEN, KUBE_CA_FILE (scripts/kube-up.sh's env file).
KUBELET_STATUS=1 gives every created Node the status a kubelet reports (addresses, conditions,
node info, 50 images), so each watch event is about the size it is in a real cluster (the Node
as created is 12 kB of JSON instead of 0.4 kB, before the API server adds its metadata and
managed fields).
"""

import base64
import http.client
import json
import os
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.parse

LOCATIONS = 100
LOCAL = "kg-bench"


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


def node(i, now):
    extra = {"status": kubelet_status(i)} if os.environ.get("KUBELET_STATUS") == "1" else {}
    return extra | {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name(i),
            "annotations": {
                "kilo.squat.ai/key": key(i),
                "kilo.squat.ai/endpoint": f"10.{1 + i // 65536}.{(i // 256) % 256}.{i % 256}:51820",
                "kilo.squat.ai/internal-ip": f"172.16.{(i // 256) % 256}.{i % 256}/16",
                "kilo.squat.ai/last-seen": str(now),
                "kilo.squat.ai/location": f"loc-{i % LOCATIONS:03d}",
                "kilo.squat.ai/granularity": "location",
            },
        },
        "spec": {"podCIDR": f"10.{64 + i // 256}.{i % 256}.0/24"},
    }


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

    def worker(start, step):
        c = connection()
        for i in range(start, n, step):
            request(c, "POST", "/api/v1/nodes", node(i, now))

    threads = [threading.Thread(target=worker, args=(s, 4)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def patch_annotation(conn, i, key_name, value):
    body = {"metadata": {"annotations": {key_name: value}}}
    request(conn, "PATCH", f"/api/v1/nodes/{name(i)}", body, "application/merge-patch+json")


def churn(n, counter):
    rate = n / 30.0
    done = [0]
    lock = threading.Lock()
    threads = 4

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
            patch_annotation(c, i, "kilo.squat.ai/last-seen", str(int(time.time())))
            k += 1
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


def peers(iface):
    out = subprocess.run(["wg", "show", iface, "peers"], capture_output=True, text=True)
    return out.stdout.split()


def move(n, iface, count):
    conn = connection()
    latencies = []
    for k in range(count):
        # A node that is not its location's first (so the old location keeps its leader).
        i = LOCATIONS * (1 + k) + 7
        if i >= n:
            i = LOCATIONS + k
        want = key(i)
        start = time.monotonic()
        patch_annotation(conn, i, "kilo.squat.ai/location", f"moved-{k}-{int(time.time())}")
        while want not in peers(iface):
            if time.monotonic() - start > 30:
                raise RuntimeError(f"{name(i)} never reached {iface}")
            time.sleep(0.005)
        latencies.append((time.monotonic() - start) * 1000)
        time.sleep(2)
    for value in latencies:
        print(f"{value:.0f}")


def main():
    what = sys.argv[1]
    n = int(sys.argv[2])
    if what == "create":
        create(n)
    elif what == "churn":
        churn(n, sys.argv[3])
    elif what == "move":
        move(n, sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
