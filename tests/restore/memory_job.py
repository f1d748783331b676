"""A test target: holds MIB MiB of random private memory, and tells what it holds.

  memory_job.py FILE MIB

At its start it writes the sha256 of its memory to FILE.start; each SIGUSR1 has it read all of
its memory again and write the sha256 and the seconds that took to FILE.now (each file written
whole, then renamed: a dump never finds one open). It counts into FILE, one line every 10 ms,
as counter.py does, so that a test sees it run.
"""

import hashlib
import os
import signal
import sys
import time

path, mib = sys.argv[1], int(sys.argv[2])
memory = bytearray(os.urandom(1 << 20)) * mib   # private anonymous pages, each one written
for at in range(0, len(memory), 1 << 20):           # and no two MiB alike
    memory[at:at + 8] = at.to_bytes(8, "little")
asked = False


def put(name: str, text: str) -> None:
    with open(name + ".tmp", "w") as f:
        f.write(text)
    os.rename(name + ".tmp", name)


def ask(_sig: int, _frame: object) -> None:
    global asked
    asked = True


signal.signal(signal.SIGUSR1, ask)
put(path + ".start", hashlib.sha256(memory).hexdigest())
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
n = 0
while True:
    if asked:
        asked = False
        t = time.monotonic()
        digest = hashlib.sha256(memory).hexdigest()
        put(path + ".now", f"{digest} {time.monotonic() - t:.6f}")
    n += 1
    os.write(fd, b"%d\n" % n)
    time.sleep(0.01)
