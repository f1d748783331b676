"""One scheduled snapshot: `python -m pos.scheduler.snapshot --pid PID --dir DIR ...`, run by
the daemon as a child process in its own session.

Why a child: the engine's Guard owns SIGINT/SIGTERM of its process while it undoes, and a
failure deep in CRIU or the driver must not take the daemon (and every other schedule) along.
SIGTERM here abandons the snapshot through the Guard: the target runs on, DIR.partial is
removed. The outcome is one JSON line on stdout: engine, path, bytes, stall_s, or error.
"""

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any, Optional

from pos.errors import BadInput, PosError
from pos.scheduler import procs, targets

ENGINES = ("auto", "driver", "concurrent", "criu")


def require_available(engine: str) -> None:
    """The engines this version has (concurrent is not one of them yet)."""
    if engine == "concurrent":
        raise BadInput("the concurrent engine is not available in this version of pos",
                       "use --engine auto, driver or criu")


def choose(engine: str, pid: int) -> str:
    """The engine that snapshots `pid`: driver (CUDA driver + CRIU) or criu (CRIU alone).

    auto: the concurrent engine where the agent is present, once this version has it;
    otherwise driver for a process with CUDA state and criu for the rest."""
    require_available(engine)
    from pos.scheduler.engine import gpu_pids

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


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Optional[list[str]] = None) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(prog="python -m pos.scheduler.snapshot")
    p.add_argument("--pid", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--engine", choices=ENGINES, default="auto")
    p.add_argument("--leave-running", action="store_true")
    p.add_argument("--db", required=True)
    a = p.parse_args(argv)
    out: dict[str, Any] = {"engine": None}
    code = 0
    try:
        from pos.scheduler import engine
        from pos.scheduler.criu import Options
        from pos.store import images

        out["engine"] = choose(a.engine, a.pid)
        if targets.agent_present(a.pid):
            print(f"PID {a.pid} runs the pos agent, but this version has no concurrent engine: "
                  "full-process snapshot", file=sys.stderr)
        result = engine.checkpoint(a.pid, Path(a.dir), Options(), a.leave_running,
                                   echo=lambda s: print(s, file=sys.stderr, flush=True))
        images.record(a.db, str(result.path), result.manifest)
        out.update(path=str(result.path), bytes=result.manifest.size_bytes,
                   stall_s=result.manifest.stall_s)
    except PosError as e:
        out["error"], code = e.message, e.exit_code
    except KeyboardInterrupt:
        out["error"], code = "the snapshot was stopped before it began", 1
    print(json.dumps(out), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
