"""The store opened by a helper process while a restore runs, so that recording the restore once
the job runs costs milliseconds: SQLAlchemy's import alone took 0.40 s of the Llama job's
restore on the H200 host, after the job's release, and beside the restore in pos's own process
it held up the image's checks (the interpreter's one lock); in a process of its own it takes
another core.

    Ahead(db) at the restore's start; .restored(path) once the job runs; .close() in any case
    (an Ahead closed before .restored records nothing)

The helper, `python -m pos.store.ahead DB` (DB "" for the default store), imports the store,
then reads one image path from stdin and marks it restored. An empty stdin (the restore failed,
or pos died) records nothing. It answers on stdout: nothing when recorded, else a Failure.
"""

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Optional

from pos import host
from pos.errors import PosError

TIMEOUT_S = 120     # the import and one UPDATE; SQLite's busy timeout is 10 s


@dataclass(frozen=True)
class Failure:
    """The helper's PosError, for pos to raise as its own."""

    cause: str
    fix: str
    exit_code: int


class Ahead:
    """pos's side of the helper."""

    def __init__(self, db: Optional[str]) -> None:
        self.proc = host.pos_module("pos.store.ahead", db or "", stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)   # a terminal's ^C is pos's to act on

    def restored(self, path: str) -> None:
        """Mark the image at `path` restored (see pos/store/images.py mark_restored)."""
        out, err = self.proc.communicate(path + "\n", timeout=TIMEOUT_S)
        if self.proc.returncode == 0:
            return
        try:
            f = Failure(**json.loads(out))
        except (ValueError, TypeError):
            last = (err.strip().splitlines() or [f"exit {self.proc.returncode}"])[-1]
            raise PosError(f"recording the restore of {path} in pos's store failed ({last})",
                           "the job runs; `pos images --db` says whether the store can be read") from None
        e = PosError(f.cause, f.fix)
        e.exit_code = f.exit_code
        raise e

    def close(self) -> None:
        """The helper ended: at once where it recorded, else told there is nothing to record."""
        if self.proc.returncode is None:
            try:
                self.proc.communicate("", timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "Ahead":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def main() -> int:
    db = sys.argv[1] or None
    from pos.store import images     # what this process is for

    path = sys.stdin.readline().strip()
    if not path:
        return 0
    try:
        images.mark_restored(db, path)
    except PosError as e:
        sys.stdout.write(json.dumps(asdict(Failure(e.cause, e.fix, e.exit_code))))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
