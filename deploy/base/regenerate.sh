#!/usr/bin/env bash
# Regenerates deploy/base/*.yaml (not kustomization.yaml, namespace.yaml) from the Helm chart's
# defaults: `helm template custody charts/custody -n custody-system`, less Helm's own labels
# (helm.sh/chart, app.kubernetes.io/managed-by), one file per chart template.
# tests/cluster_static.rs (kustomize_base_equals_chart_defaults) fails when they drift.
#
#   deploy/base/regenerate.sh            # helm from tests/cluster/build.sh (cached)
#   HELM=/path/to/helm deploy/base/regenerate.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
helm="${HELM:-$(tests/cluster/build.sh)/helm}"
"$helm" template custody charts/custody -n custody-system | python3 -c '
import re, sys
groups = {}
for doc in sys.stdin.read().split("\n---\n"):
    m = re.search(r"# Source: custody/templates/(\S+)", doc)
    if not m:
        continue
    lines = [l for l in doc.strip("\n").split("\n")
             if not l.startswith("# Source:") and l.strip() != "---"
             and "helm.sh/chart:" not in l and "app.kubernetes.io/managed-by:" not in l]
    groups.setdefault(m.group(1), []).append("\n".join(lines).strip("\n"))
head = ("# Generated from the Helm chart'"'"'s defaults by deploy/base/regenerate.sh (helm template custody\n"
        "# charts/custody -n custody-system, less the labels helm.sh/chart and\n"
        "# app.kubernetes.io/managed-by); tests/cluster_static.rs checks that they stay equivalent.\n")
for src, bodies in groups.items():
    with open("deploy/base/" + src, "w") as f:
        f.write(head + "---\n" + "\n---\n".join(bodies) + "\n")
    print("deploy/base/" + src, file=sys.stderr)
'
