"""A GPU job of many buffers that knows nothing of pos, for checking images exactly.

  python workloads/fill_job.py --buffers 48 --mib 64 [--pause-file F]

Operation k (k = 1, 2, ...) fills buffer (k-1) % N with the int32 k: one kernel launch each.
So the state after exactly K operations is: buffer b holds the last k <= K with
(k-1) % N == b (`torn` checks an image against that). While --pause-file exists the
job makes no CUDA call at all (it sleeps), so that a restored image can be read back as it is.
"""

import argparse
import os
import time
from pathlib import Path
from typing import Optional, Sequence


def torn(values: Sequence[int]) -> bool:
    """Whether buffer values (one per buffer, in any order: an image lists buffers by address)
    are NOT the state after some exact number of operations K. That state holds the last N
    operations' values, one per buffer (each buffer takes one residue of k mod N), and zeros
    for buffers not yet written."""
    n, k = len(values), max(values, default=0)
    window = list(range(max(1, k - n + 1), k + 1))
    return sorted(values) != [0] * (n - len(window)) + window


def image_values(folder: Path, rank: Optional[int] = None) -> list[int]:
    """One value per buffer of a pos GPU image of this job (`rank`: of that process of an image
    of several; a whole buffer is filled at once, so a buffer that is not uniform is torn too:
    AssertionError)."""
    import numpy as np

    from pos.image import gpu, gpuindex

    out = []
    saved = gpuindex.saved(folder, gpuindex.read(folder, rank))
    for _base, (where, _size, chunks) in sorted(saved.items()):
        seen: set[int] = set()
        for c in chunks:
            buf = np.empty(c.raw, np.uint8)
            gpu.read_chunk(where, c, buf)
            seen.update(np.unique(buf[: c.raw // 4 * 4].view(np.uint32)).tolist())
        assert len(seen) == 1, f"a buffer of {folder} is not uniform: {sorted(seen)[:4]}"
        out.append(seen.pop())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--buffers", type=int, default=48)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--pause-file")
    a = ap.parse_args()
    import torch

    n = a.mib << 20 >> 2
    bufs = [torch.zeros(n, dtype=torch.int32, device="cuda") for _ in range(a.buffers)]
    torch.cuda.synchronize()
    print(f"READY {os.getpid()}", flush=True)
    k = 0
    while True:
        if a.pause_file and os.path.exists(a.pause_file):
            torch.cuda.synchronize()
            while os.path.exists(a.pause_file):
                time.sleep(0.01)
        k += 1
        bufs[(k - 1) % a.buffers].fill_(k)
        if k % 256 == 0:
            torch.cuda.synchronize()


if __name__ == "__main__":
    main()
