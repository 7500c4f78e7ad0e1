"""kg's writes to the API server, read from the API server's audit log (bench/scale.sh --writes).

    api_writes.py policy             print an audit policy that logs every write (create, update,
                                     patch, delete) at the Metadata level and nothing else
    api_writes.py peers P            print P Kilo Peers, one allowed /32 each, as a kubectl list
    api_writes.py count LOG T0 T1 WINDOW
                                     print the writes kg sent (user agent `kg/...`) that the API
                                     server received from Unix time T0 to T1, by kind, with
                                     their rate a minute; WINDOW names the line

The kinds: `annotations` (patches of kg's Node: its check-ins, key and endpoints, which Kilo's kg
makes too), `condition` (`nodes/status`: KiloMeshReady), `events` (events.k8s.io Events, new
and repeated), `peer status` (`peers/status`), `leases` (coordination.k8s.io Leases) and any
other as resource/subresource and verb. The first three after annotations are what publishing
the mesh's state costs.
"""

import base64
import datetime
import json
import struct
import sys

POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived"]
rules:
  - level: Metadata
    verbs: ["create", "update", "patch", "delete", "deletecollection"]
  - level: None
"""

KINDS = ["annotations", "condition", "events", "peer status", "leases"]
MESH_STATE = ["condition", "events", "peer status"]


def peers(count):
    items = []
    for p in range(count):
        key = base64.b64encode(b"bench-peer" + struct.pack("<I", p) + bytes(18)).decode()
        items.append({
            "apiVersion": "kilo.squat.ai/v1alpha1",
            "kind": "Peer",
            "metadata": {"name": f"bench-peer-{p:04d}"},
            "spec": {
                "allowedIPs": [f"10.252.{p // 250}.{p % 250 + 1}/32"],
                "publicKey": key,
                "persistentKeepalive": 10,
            },
        })
    print(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def kind(entry):
    ref = entry.get("objectRef", {})
    resource, sub = ref.get("resource", ""), ref.get("subresource", "")
    if resource == "nodes" and not sub:
        return "annotations"
    if resource == "nodes" and sub == "status":
        return "condition"
    if resource == "events":
        return "events"
    if resource == "peers" and sub == "status":
        return "peer status"
    if resource == "leases":
        return "leases"
    return f"{resource}/{sub} {entry.get('verb', '')}".replace("/ ", " ")


def received(entry):
    stamp = entry["requestReceivedTimestamp"].replace("Z", "+00:00")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def count(log, t0, t1, window):
    counts = {k: 0 for k in KINDS}
    with open(log) as lines:
        for line in lines:
            entry = json.loads(line)
            if not entry.get("userAgent", "").startswith("kg/"):
                continue
            if not t0 <= received(entry) < t1:
                continue
            what = kind(entry)
            counts[what] = counts.get(what, 0) + 1
    minutes = (t1 - t0) / 60
    parts = ", ".join(f"{k} {v} ({v / minutes:.2f}/min)" for k, v in counts.items())
    mesh = sum(counts[k] for k in MESH_STATE)
    print(f"kg's writes, {window} ({t1 - t0:.0f} s): {parts}; the mesh's state "
          f"{mesh} ({mesh / minutes:.2f}/min)")


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "policy":
        sys.stdout.write(POLICY)
    elif what == "peers":
        peers(int(sys.argv[2]))
    elif what == "count":
        count(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
