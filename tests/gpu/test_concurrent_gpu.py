"""The concurrent engine on the GPU, from outside a job that knows nothing of pos: GPU images
taken at moments the job does not choose are each the state after an exact number of kernels,
and one restored into the (paused) job reads back equal, buffer by buffer."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path


from pos import concurrent
from pos.image.opened import open_image
from workloads.fill_job import image_values, torn

ROOT = Path(__file__).resolve().parent.parent.parent


def test_images_from_outside_are_exact_and_restore_reads_back(tmp_path: Path) -> None:
    pause = tmp_path / "pause"
    job = subprocess.Popen([sys.executable, "-m", "pos.cli", "run", "--", sys.executable,
                            str(ROOT / "workloads" / "fill_job.py"), "--buffers", "24", "--mib",
                            "32", "--pause-file", str(pause)], cwd=ROOT, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        assert job.stdout.readline().startswith("READY")
        ops = []
        for i in range(3):
            time.sleep(random.uniform(0.2, 1.0))
            r = concurrent.checkpoint_gpu(job.pid, tmp_path / f"img{i}")
            v = image_values(Path(r.path))
            assert not torn(v), v
            ops.append(max(v))
        assert ops == sorted(ops) and ops[0] > 0
        pause.touch()
        time.sleep(0.3)
        concurrent.restore_gpu(job.pid, open_image(tmp_path / "img0"))
        back = concurrent.checkpoint_gpu(job.pid, tmp_path / "back")
        assert image_values(Path(back.path)) == image_values(tmp_path / "img0")
        pause.unlink()
        time.sleep(0.3)
        assert job.poll() is None
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
