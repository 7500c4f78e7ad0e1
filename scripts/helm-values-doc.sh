#!/usr/bin/env bash
# Print the Markdown table of the chart's values: one row per value of
# charts/kilotun/values.schema.json (path, type, default from charts/kilotun/values.yaml,
# description). docs/helm.md embeds this output between its
# `<!-- values table: scripts/helm-values-doc.sh -->` and `<!-- end of values table -->` markers;
# tests/helm/lint.sh checks that the two are the same.
#
#   scripts/helm-values-doc.sh
#
# It fails, naming them, when values.yaml holds a value the schema does not describe, or the
# schema describes a value values.yaml lacks. Needs python3 with PyYAML (Debian: python3-yaml).
set -euo pipefail

chart=$(cd "$(dirname "${BASH_SOURCE[0]}")/../charts/kilotun" && pwd)
python=python3
# Debian's python3 (with python3-yaml) when the one found first lacks PyYAML.
if ! "$python" -c 'import yaml' 2>/dev/null && [[ -x /usr/bin/python3 ]]; then
	python=/usr/bin/python3
fi
"$python" -c 'import yaml' 2>/dev/null || {
	echo "helm-values-doc.sh: error: python3 with PyYAML is needed (apt-get install python3-yaml)" >&2
	exit 1
}

exec "$python" - "$chart/values.schema.json" "$chart/values.yaml" <<'EOF'
import json, sys, yaml

schema = json.load(open(sys.argv[1]))
values = yaml.safe_load(open(sys.argv[2]))
rows, problems = [], []
MISSING = object()

def kind(node):
    if "enum" in node:
        return " \\| ".join(json.dumps(v) for v in node["enum"])
    if "anyOf" in node:
        return " or ".join(kind(n) for n in node["anyOf"])
    t = node.get("type", "any")
    if t == "array" and isinstance(node.get("items"), dict) and "type" in node["items"]:
        return f"list of {node['items']['type']}"
    return t

def show(value):
    if value is MISSING:
        return ""
    return "`" + json.dumps(value, separators=(", ", ": ")) + "`"

def walk(node, value, path):
    props = node.get("properties")
    if node.get("type") == "object" and props and node.get("additionalProperties") is False:
        if value is MISSING or not isinstance(value, dict):
            value = {}
        for key in value:
            if key not in props:
                problems.append(f"values.yaml has {'.'.join(path + [key])}, which the schema does not describe")
        for key, child in props.items():
            walk(child, value.get(key, MISSING), path + [key])
        return
    name = ".".join(path)
    if name == "global":
        return
    if value is MISSING:
        problems.append(f"the schema describes {name}, which values.yaml lacks")
    description = node.get("description", "").replace("|", "\\|")
    if not description:
        problems.append(f"the schema has no description for {name}")
    rows.append(f"| `{name}` | {kind(node)} | {show(value)} | {description} |")

walk(schema, values, [])
if problems:
    for p in problems:
        print(f"helm-values-doc.sh: error: {p}", file=sys.stderr)
    sys.exit(1)
print("| Value | Type | Default | What it sets |")
print("| --- | --- | --- | --- |")
print("\n".join(rows))
EOF
