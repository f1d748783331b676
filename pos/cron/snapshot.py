"""One scheduled snapshot: `python -m pos.cron.snapshot --pid PID --dir DIR ...`, run by
the daemon as a child process in its own session.

Why a child: the engine's Guard owns SIGINT/SIGTERM of its process while it undoes, and a
failure deep in CRIU or the driver must not take the daemon (and every other schedule) along.
SIGTERM here abandons the snapshot through the Guard: the target runs on, DIR.partial is
removed. The concurrent engine takes a whole-process image of a `pos run` job through its
agent while the job runs (and ends the job only without --leave-running, once the image is
sealed); an image sealed after the daemon stopped waiting is recorded later (Daemon._adopt).
The outcome is one JSON line on stdout: engine, path, bytes, stall_s (for the concurrent
engine: the longest time the agent held a call of the job), or error.
"""

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Optional

from pos import image
from pos.cron import targets
from pos.errors import BadInput, PosError
from pos.process import procs
from pos.process.criu import Options

ENGINES = ("auto", "driver", "concurrent", "criu")
# the schedule's engine names, and pos's engine for each (CRIU alone is the stop-the-world
# engine on a process without CUDA state)
ENGINE_OF = {"driver": "stop-the-world", "criu": "stop-the-world", "concurrent": "concurrent"}


def choose(engine: str, pid: int) -> str:
    """The engine that snapshots `pid`: concurrent (a whole-process image of a `pos run` job,
    taken while it runs), driver (CUDA driver + CRIU) or criu (CRIU alone).

    auto: concurrent where the agent answers, else driver for a process with CUDA state and
    criu for the rest."""
    agent = targets.agent_present(pid)
    if engine == "concurrent":
        if not agent:
            raise BadInput(f"PID {pid} has no pos agent that owns its memory, so the "
                           "concurrent engine cannot snapshot it", "start the job with `pos run`, "
                           "or use --engine auto")
        return engine
    if engine == "auto" and agent:
        return "concurrent"
    from pos.process.cudackpt import gpu_pids

    cuda = gpu_pids(procs.tree(pid))
    if engine == "auto":
        return "driver" if cuda else "criu"
    if engine == "driver" and not cuda:
        raise BadInput(f"PID {pid} holds no CUDA state, so the driver engine has nothing to save",
                       "use --engine criu or auto for a CPU process")
    if engine == "criu" and cuda:
        raise BadInput(f"PID {pid} holds CUDA state, which CRIU alone cannot save",
                       "use --engine driver or auto")
    return engine


def take(engine: str, pid: int, directory: Path, options: Options, leave_running: bool,
         db: str) -> dict[str, Any]:
    """Snapshot `pid` with `engine` (as `choose` gave it), record the image in the store; the
    outcome's path, bytes and stall_s."""
    from pos.engines import engines
    from pos.settings import Settings
    from pos.store import images

    chosen = engines.by_name(ENGINE_OF[engine], Settings.from_env(),
                             echo=lambda s: print(s, file=sys.stderr, flush=True))
    report = chosen.checkpoint(pid, directory, engines.Save(options, leave_running))
    manifest = report.manifest or image.load(Path(report.path))
    images.record(db, report.path, manifest.to_json())
    return {"path": report.path, "bytes": manifest.size_bytes, "stall_s": report.held_s}


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(prog="python -m pos.cron.snapshot")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--engine", choices=ENGINES, default="auto")
    p.add_argument("--leave-running", action="store_true")
    p.add_argument("--criu-options", default="{}", help="JSON of criu.Options")
    p.add_argument("--db", required=True)
    a = p.parse_args(argv)
    out: dict[str, Any] = {"engine": None}
    code = 0
    try:
        out["engine"] = choose(a.engine, a.pid)
        out.update(take(out["engine"], a.pid, Path(a.dir),
                        Options.from_json(json.loads(a.criu_options)), a.leave_running, a.db))
    except PosError as e:
        out["error"], code = e.message, e.exit_code
    except KeyboardInterrupt:
        code = 1
        out["error"] = (f"the snapshot was abandoned; the agent of PID {a.pid} may still finish "
                        f"its image in {a.dir}, which the daemon records at the schedule's next "
                        "snapshot" if out["engine"] == "concurrent"
                        else "the snapshot was stopped before it began")
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
