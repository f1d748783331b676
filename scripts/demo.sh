#!/usr/bin/env bash
# The main job, end to end, after setting the host up (scripts/setup.sh; needs root):
# start a GPU workload, trace it with `pos trace`, and export what was recorded.
#   - where an NVIDIA GPU and PyTorch are present: a PyTorch training job
#     (workloads/torch_job.py) on the GPU;
#   - otherwise: the fake-driver workload of the tests (tests/fakegpu), which proves the
#     plumbing only -- it says so.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
out=${POS_DEMO_DIR:-/tmp/pos-demo}
mkdir -p "$out"
db="$out/demo.db"
rm -f "$db" "$db"-*
.venv/bin/pos doctor || true
exec .venv/bin/python -m workloads.demo --db "$db" --out "$out"
