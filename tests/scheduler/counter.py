"""A test target: counts 1, 2, 3 ... into FILE, one line every 10 ms, forever.

  counter.py FILE [--children N] [--cuda LIBCUDA] [--ballast-mb M]

--children N forks N children after start, child i counting into FILE.i (a process tree);
--cuda calls cuInit of that library first, so that the process holds (fake) CUDA state.
--ballast-mb M keeps M MiB of touched memory, so that a dump takes a while.
The file is opened with O_APPEND: after a restore the counter appends where it left off.
"""

import argparse
import ctypes
import os
import time

args = argparse.ArgumentParser()
args.add_argument("file")
args.add_argument("--children", type=int, default=0)
args.add_argument("--cuda")
args.add_argument("--ballast-mb", type=int, default=0)
a = args.parse_args()
ballast = b"\1" * (a.ballast_mb << 20)
if a.cuda:
    assert ctypes.CDLL(a.cuda).cuInit(0) == 0
path = a.file
for i in range(a.children):
    if os.fork() == 0:
        path = f"{a.file}.{i}"
        break
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
n = 0
while True:
    n += 1
    os.write(fd, b"%d\n" % n)
    time.sleep(0.01)
