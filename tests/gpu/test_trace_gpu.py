"""`pos trace` on a real GPU: every kernel a PyTorch training loop launches is recorded, with
its name and parameter layout. Costs are measured by bench/trace_gpu.py, not here."""

import json
from pathlib import Path

import pytest

from workloads.harness import count_run


@pytest.mark.bpf
def test_training_launches_match_the_profiler(tmp_path: Path, bpf_ready: None) -> None:
    r = count_run(str(tmp_path / "t.db"), steps=5)
    # whole, to the log (bench/device.sh runs this with -s): pytest cuts an assertion's message,
    # and the kernels without a layout, with the reason for each, are what a failure needs
    print(json.dumps(r, indent=1))
    assert r["traced_launches"] == r["profiler_kernels"], r
    assert r["named_share"] >= 0.99, r
    assert r["layout_known_share"] >= 0.99, r
    assert r["lost_events"] == 0, r
