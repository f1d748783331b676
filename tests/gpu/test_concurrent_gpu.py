"""The concurrent checkpoint on the GPU: a training job under `pos run` takes a GPU image of
itself at a step boundary and trains on; the image is restored into it *on demand* (the job
trains again from the moment the restore starts, its calls held only for buffers not back
yet), and the re-run losses must equal the recorded ones bit for bit. An idle image at the
same cut (stop-the-world) must hold the same bytes as the concurrent one, buffer by buffer.
With --track-dirty the copy order comes from the agent's history (the analyzer's rule)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pos.agent import gpuimage

ROOT = Path(__file__).resolve().parent.parent.parent
SMALL = ["--layers", "4", "--d", "512", "--heads", "8", "--ctx", "256", "--batch", "8",
         "--steps", "20", "--at", "8"]


def run_job(tmp_path: Path, extra_env: dict[str, str], *args: str,
            run_flags: tuple[str, ...] = ()) -> str:
    env = dict(os.environ, **extra_env)
    r = subprocess.run([sys.executable, "-m", "pos.cli", "run", *run_flags, "--", sys.executable,
                        str(ROOT / "workloads" / "train_conc.py"), *SMALL, *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    return out


def hashes(folder: Path) -> dict[int, list[str]]:
    return {base: [c["hash"] for c in sorted(chunks, key=lambda c: c["offset"])]
            for base, (_, _, chunks) in gpuimage.resolve(folder).items()}


def tagged(out: str, tag: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith(tag + " ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len(tag) + 1:])


@pytest.mark.parametrize("mode", ["validated-only", "trust-speculation+history"])
def test_restore_into_the_running_job_reruns_bit_exact(tmp_path: Path, mode: str) -> None:
    history = mode.endswith("+history")
    env = {"POS_TRUST_SPECULATION": "1"} if mode.startswith("trust") else {}
    out = run_job(tmp_path, env, "-D", str(tmp_path / "img"), "--quiescent",
                  str(tmp_path / "idle"), "--verify",
                  run_flags=("--track-dirty",) if history else ())
    reruns = [line for line in out.splitlines() if line.startswith("RERUN")]
    assert len(reruns) == 12 and all(line.endswith(" same") for line in reruns), out
    idle, conc = hashes(tmp_path / "idle"), hashes(tmp_path / "img")
    assert idle.keys() == conc.keys() and idle == conc
    report, restore = tagged(out, "REPORT"), tagged(out, "RESTORE")
    assert report["order_source"] == ("history" if history else "size"), report
    assert restore["on_demand"] and restore["bytes"] == report["bytes"], restore
    assert restore["release_s"] < 5 and restore["first_step_s"] is not None, restore
    print(json.dumps({"mode": mode, "checkpoint": report, "restore": restore}))
