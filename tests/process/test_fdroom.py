"""pos/process/fdroom.py against the kernel: the table holds the room asked for, within
RLIMIT_NOFILE, and no descriptor is left open or touched."""

import os
import resource
import subprocess
import sys

from pos.process import fdroom


def table_size(pid: str = "self") -> int:
    """The slots of the process's table of descriptors (/proc/PID/status, FDSize)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("FDSize:"))


def open_fds() -> dict[int, tuple[int, int]]:
    """Each open descriptor's device and inode, but the listing's own."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(int(name))
        except OSError:
            continue            # the listing's descriptor, closed by now
        out[int(name)] = (st.st_dev, st.st_ino)
    return out


def test_the_table_holds_the_room_asked_and_no_descriptor_is_touched() -> None:
    before, size = open_fds(), table_size()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = min(size + 1000, soft - max(before) - 8)
    assert max(before) + n >= size, f"RLIMIT_NOFILE {soft} leaves too little room to tell"
    fdroom.make(n)
    assert table_size() > max(before) + n - 1
    assert open_fds() == before


def _in_a_child(soft: int, hard: int, make: str) -> list[int]:
    """In a new process with RLIMIT_NOFILE (soft, hard): `make`'s calls of fdroom.make, then
    the table's size and the soft limit."""
    code = ("import resource; from pos.process import fdroom; from tests.process.test_fdroom "
            f"import table_size; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
            f"{make}; print(table_size(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert r.returncode == 0, r.stderr
    return [int(v) for v in r.stdout.split()]


def test_the_room_stays_within_the_hard_limit() -> None:
    """Asked for more than RLIMIT_NOFILE allows, the table grows as far as the limit lets it
    (the kernel rounds a table's size up) and no further, and nothing is raised."""
    size, soft = _in_a_child(300, 300, "fdroom.make(100000); fdroom.make(1 << 40)")
    assert 256 <= size <= 512 and soft == 300


def test_the_soft_limit_is_raised_toward_the_hard_one_for_the_room() -> None:
    """A job's own memory can come in thousands of pieces, a descriptor each: the soft limit
    is raised for them, as far as the hard one and no further."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert hard >= 4096, f"a hard RLIMIT_NOFILE of {hard} leaves too little room to tell"
    size, soft = _in_a_child(300, 4096, "fdroom.make(2000)")
    assert soft > 2000 and size > 2000
    size, soft = _in_a_child(300, 4096, "fdroom.make(1 << 40)")
    assert soft == 4096 and 4096 <= size <= 8192
