"""The store opened by a helper process while a restore runs, so that recording the restore once
the job runs costs milliseconds: SQLAlchemy's import and the store's opening took 0.29-0.40 s
of the Llama job's restore on the H200 host, after the job's release; beside the restore in
pos's own process they held up the image's checks (the interpreter's one lock). In a process of
its own they take another core.

    Ahead(db) at the restore's start; .restored(path) once the job runs; .close() in any case
    (an Ahead closed before .restored records nothing)

The helper, `python -m pos.store.ahead DB` (DB "" for the default store), imports and opens the
store, then reads one image path from stdin and marks it restored. An empty stdin (the restore
failed, or pos died) records nothing. It answers with one line on stdout, before it exits: the
JSON of a Told (pos/errors.py), or an empty object when recorded.
"""

import json
import subprocess
import sys
from dataclasses import asdict
from typing import Optional

from pos import host
from pos.errors import PosError, Told

TIMEOUT_S = 120     # the import and one UPDATE; SQLite's busy timeout is 10 s


class Ahead:
    """pos's side of the helper."""

    def __init__(self, db: Optional[str]) -> None:
        self.proc = host.pos_module("pos.store.ahead", db or "", stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    start_new_session=True)   # a terminal's ^C is pos's to act on
        self.answered = False

    def restored(self, path: str) -> None:
        """Mark the image at `path` restored (see pos/store/images.py mark_restored)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(path + "\n")
            self.proc.stdin.close()
        except BrokenPipeError:       # it died: its stderr says why
            pass
        answer = self.proc.stdout.readline()
        self.answered = bool(answer)
        try:
            fields = json.loads(answer)
        except ValueError:
            _, err = self.proc.communicate(timeout=TIMEOUT_S)
            last = (err.strip().splitlines() or [f"exit {self.proc.returncode}"])[-1]
            raise PosError(f"recording the restore of {path} in pos's store failed ({last})",
                           "the job runs; `pos images --db` says whether the store can be "
                           "read") from None
        if fields:
            raise Told(**fields).error()

    def close(self) -> None:
        """Unless it answered (it ends on its own then), the helper told there is nothing to
        record, and ended."""
        if self.answered or self.proc.returncode is not None:
            return
        try:
            self.proc.communicate("", timeout=TIMEOUT_S)
        except (subprocess.TimeoutExpired, ValueError, OSError):
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Ahead":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def main() -> int:
    db = sys.argv[1] or None
    from pos.store import db as store
    from pos.store import images

    engine, failed = None, None
    try:
        engine = store.open_store(db)     # ready: the UPDATE alone then waits for the job
    except PosError as e:
        failed = e
    path = sys.stdin.readline().strip()
    if not path:
        return 0
    try:
        if failed is not None:
            raise failed
        images.mark_restored(db, path, engine)
    except PosError as e:
        print(json.dumps(asdict(Told.of(e))), flush=True)
        return 1
    print("{}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
