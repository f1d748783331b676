"""Inference servers started warm (issue 36), on an NVIDIA GPU with PyTorch and transformers
(root):

    python3 bench/serve_gpu.py --out DIR [--models gpt2-large,llama-7b] [--cases ...]
                               [--clones N] [--work /var/tmp/pos-serve]

For each model, workloads/serve_lm.py (a server that knows nothing of pos: transformers, bf16,
weights in safetensors that this bench writes with random values, no hub) is started three
ways, each with the page cache dropped and then warm:
  cold         a new process;
  stw          the warmed server saved with `pos checkpoint PID -D DIR`, then `pos restore`;
  concurrent   a warmed server under `pos run`, saved with `pos checkpoint --concurrent
               --leave-running`, killed, then `pos restore`;
  clone        (--clones N) a warmed server under `pos run --clonable`, saved concurrently,
               killed, then N `pos restore --to-gpu I` of the one image at once.
The figure is the time from the start (the spawn, or `pos restore`) until the first one-token
answer, read from the server's own clock (the request is dropped before the start); then a
32-token answer is compared with the cold server's. The disk's sequential read bandwidth is
measured in the same run, with the page cache dropped. The driver's restore of each image is
also measured alone, on the restored server: the driver's lock, checkpoint, restore and unlock
(for a `pos run` server, with its memory given up first, as the concurrent engine does).

Writes DIR/serve.json: {"machine", "rows": one per start with the issue's keys, "runs": the
raw reports}; the servers' logs beside it.
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from concurrent_gpu import POS, PY, ROOT, machine  # noqa: E402

from pos.process import procs  # noqa: E402

GIB = 2**30
SERVER = str(ROOT / "workloads" / "serve_lm.py")
PROMPT = list(range(100, 164))         # 64 token ids
FULL_TOKENS = 32
ANSWER_TIMEOUT_S = 300.0

# the two shapes of the issue, random weights in bf16
MODELS: dict[str, dict[str, Any]] = {
    "gpt2-large": {"model_type": "gpt2", "n_embd": 1280, "n_layer": 36, "n_head": 20,
                   "n_positions": 1024, "vocab_size": 50257},
    "llama-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
                 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
                 "vocab_size": 32000, "max_position_embeddings": 2048},
}


# ----------------------------------------------------------------------------- the host

def subreaper() -> None:
    """Restored servers outlive the `pos restore` that started them: they become this
    process's children, which it can wait for."""
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def disk_read_gbps(files: list[Path], threads: int = 8) -> dict[str, float]:
    """The disk's sequential read bandwidth: `files` read with the page cache dropped, by one
    thread and by `threads` threads on contiguous parts."""
    piece = 16 << 20

    def read(path: Path, start: int, end: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        buf = bytearray(piece)
        try:
            at = start
            while at < end:
                n = os.preadv(fd, [memoryview(buf)[:min(piece, end - at)]], at)
                if n <= 0:
                    break
                at += n
        finally:
            os.close(fd)

    total = sum(f.stat().st_size for f in files)
    out = {}
    for n in (1, threads):
        drop_caches()
        t = time.monotonic()
        jobs = []
        for f in files:
            size = f.stat().st_size
            step = -(-size // n)
            jobs += [threading.Thread(target=read, args=(f, i * step, min(size, (i + 1) * step)))
                     for i in range(n)]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join()
        out[f"threads_{n}"] = round(total / (time.monotonic() - t) / 1e9, 2)
    drop_caches()
    return out


def proc_state(pid: int) -> Optional[str]:
    """The state letter of process `pid` (/proc/PID/stat), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def wait_ended(pid: int, limit_s: float = 600) -> None:
    """Until process `pid` (not this one's child) has ended, at most `limit_s`: gone, or a
    zombie, which this subreaper reaps where it became its child."""
    t = time.monotonic()
    while time.monotonic() - t < limit_s:
        state = proc_state(pid)
        if state is None or state == "Z":
            reap()
            return
        time.sleep(0.01)


def kill_pid(pid: int) -> None:
    """SIGKILL a server and wait until its PID is free (its parent, or this subreaper, reaped
    it)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    t = time.monotonic()
    while time.monotonic() - t < 30:
        reap()
        state = proc_state(pid)
        if state is None:
            return
        if state == "Z":
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        time.sleep(0.02)


# ----------------------------------------------------------------------------- the server

def write_model(name: str, folder: Path) -> dict[str, Any]:
    """The model's random bf16 weights in safetensors under `folder` (kept between runs)."""
    done = folder / "written.json"
    if done.exists():
        return json.loads(done.read_text())
    code = (
        "import json, sys, torch\n"
        "from transformers import AutoConfig, AutoModelForCausalLM\n"
        "cfg = dict(json.loads(sys.argv[1])); kind = cfg.pop('model_type')\n"
        "config = AutoConfig.for_model(kind, **cfg)\n"
        "torch.manual_seed(0)\n"
        "with torch.device('cuda'):\n"
        "    m = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)\n"
        "m.save_pretrained(sys.argv[2])\n"
        "print(json.dumps({'params': sum(p.numel() for p in m.parameters())}))\n")
    folder.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    r = subprocess.run([PY, "-c", code, json.dumps(MODELS[name]), str(folder)],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise SystemExit(f"writing {name} failed: {r.stderr[-3000:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    info["weights_gib"] = round(sum(f.stat().st_size for f in folder.glob("*.safetensors"))
                                / GIB, 2)
    info["write_s"] = round(time.monotonic() - t, 1)
    done.write_text(json.dumps(info))
    return info


class Requests:
    """The folder the servers read requests from."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.clear()

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder.mkdir(parents=True)

    def ask(self, rid: str, new: int) -> None:
        tmp = self.folder / f"{rid}.tmp"
        tmp.write_text(json.dumps({"tokens": PROMPT, "new": new}))
        os.rename(tmp, self.folder / f"{rid}.req")

    def answers(self, rid: str, n: int = 1, timeout: float = ANSWER_TIMEOUT_S,
                alive: Optional[subprocess.Popen] = None) -> list[dict[str, Any]]:
        """The first `n` answers to `rid`, each {"tokens", "t_claimed", "t_done", "tag"}."""
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            found = sorted(self.folder.glob(f"{rid}.*.ans"))
            if len(found) >= n:
                return [json.loads(f.read_text()) for f in found[:n]]
            if alive is not None and alive.poll() not in (None, 0):
                raise RuntimeError(f"the server or pos ended (exit {alive.returncode}) before "
                                   f"answering {rid}")
            time.sleep(0.002)
        raise RuntimeError(f"no answer to {rid} within {timeout:.0f} s")

    def ready(self, p: Optional[subprocess.Popen] = None, timeout: float = 600
              ) -> dict[str, Any]:
        """The server's ready file; RuntimeError once `p` (the server or its launcher) ended
        without one."""
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            found = list(self.folder.glob("ready-*"))
            if found:
                return json.loads(found[0].read_text())
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"the server ended (exit {p.returncode}) before it was ready")
            time.sleep(0.05)
        raise RuntimeError("the server did not get ready")


def spawn(model_dir: Path, req: Requests, log: Path, prefix: tuple[str, ...] = ()
          ) -> subprocess.Popen:
    return subprocess.Popen([*prefix, PY, SERVER, str(model_dir), str(req.folder)], cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=open(log, "ab"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def pos_async(*args: str, env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    return subprocess.Popen([*POS, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


# how each case restores a concurrent image: `pos restore`'s extra arguments and environment
# (concurrent: in the command's own process, which waits for the fill, as before; -lazy: the
# same with CRIU's lazy pages; -detached: as `pos restore` does where no service runs, a
# detached process of pos's own restoring and filling, the command returning once the server
# runs; -service: through `pos restore-service`, which has its imports, NVML and CUDA contexts
# made before; -standby: the same, the server held ready there first with `pos restore
# --standby`, timed apart)
NO_SERVICE = {"POS_RESTORE_SOCKET": "/nonexistent/restore.sock"}   # no service answers there
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    "concurrent": (("--no-service",), {}),
    "concurrent-lazy": (("--no-service",), {"POS_LAZY_PAGES": "1"}),
    "concurrent-detached": ((), NO_SERVICE),
    "concurrent-service": ((), {}),
    "concurrent-standby": ((), {}),
}
# concurrent-notrim: an image of its own, taken with POS_TRIM_HEAP=0 (the job's heap as it
# is), restored as `concurrent` is


class Service:
    """`pos restore-service` on a socket of this run's own, started once, stopped at the end;
    `env`: its settings (POS_LAZY_PAGES ...)."""

    def __init__(self, socket: Path, log: Path, env: dict[str, str]) -> None:
        self.socket = socket
        self.proc = subprocess.Popen([*POS, "restore-service", "--socket", str(socket)],
                                     cwd=ROOT, stdout=subprocess.PIPE, stderr=open(log, "ab"),
                                     text=True, env={**os.environ, **env},
                                     start_new_session=True)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            raise SystemExit(f"pos restore-service did not start: {line!r} (see {log})")
        # what it says of each restore (its fill's end, after an early answer) goes to the
        # log beside its errors
        threading.Thread(target=self.keep, args=(log,), daemon=True).start()

    def keep(self, log: Path) -> None:
        assert self.proc.stdout is not None
        with open(log, "a") as f:
            for line in self.proc.stdout:
                f.write(line)
                f.flush()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def exit_watch(p: subprocess.Popen) -> None:
    """Note the moment `p` exits (its output, a report of a few KiB, fits the pipes), so that
    finish() can say when, not only by when."""
    def watch() -> None:
        try:
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)    # left for communicate
        except ChildProcessError:
            return
        p.exited_at = time.time()    # type: ignore[attr-defined]

    threading.Thread(target=watch, daemon=True).start()


def finish(p: subprocess.Popen, t0: float, timeout: float = 600) -> dict[str, Any]:
    """A `pos` command's end: exit, its wall time from t0 (time.time()): when it exited where
    exit_watch watched it, else when it was found ended; its JSON report."""
    out, err = p.communicate(timeout=timeout)
    at = getattr(p, "exited_at", None) or time.time()
    res: dict[str, Any] = {"rc": p.returncode, "exit_s": round(at - t0, 3),
                           "err": err[-2000:]}
    lines = out.strip().splitlines()
    if p.returncode == 0 and lines:
        try:
            res["report"] = json.loads(lines[-1])
        except json.JSONDecodeError:
            res["out"] = out[-2000:]
    else:
        res["out"] = out[-2000:]
    return res


def ckpt_split(ckpt: dict[str, Any]) -> dict[str, float]:
    """What the checkpoint's report says of CRIU's part: the heap's trim, CRIU's pages."""
    tim = (ckpt.get("report") or {}).get("timings") or {}
    return {k: round(tim[k], 3) for k in ("trim", "hoist", "dump", "frozen", "criu_written_mib",
                                          "criu_pages_written_n") if k in tim}


def host_memory(pid: int) -> dict[str, Any]:
    """What CRIU will write of the server's tree: its anonymous memory, by mapping."""
    from scale_gpu import anon_top

    out: dict[str, Any] = {}
    for p in procs.tree(pid):
        roll = Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()
        fields = {ln.split()[0].rstrip(":"): int(ln.split()[1]) for ln in roll[1:]
                  if len(ln.split()) >= 2 and ln.split()[1].isdigit()}
        out[str(p)] = {"anon_mib": round(fields.get("Anonymous", 0) / 1024, 1),
                       "rss_mib": round(fields.get("Rss", 0) / 1024, 1),
                       "private_dirty_mib": round(fields.get("Private_Dirty", 0) / 1024, 1),
                       "mappings": len(Path(f"/proc/{p}/maps").read_text().splitlines()),
                       "threads": len(os.listdir(f"/proc/{p}/task")),
                       "top": anon_top(p, 12)}
    return out


# ----------------------------------------------------------------------------- the driver alone

def driver_alone(pid: int, under_pos: bool) -> dict[str, float]:
    """The driver's restore of the restored server, measured alone: for a `pos run` server its
    memory given up first (bench/floor_gpu.py's driver_floor), else the driver's four calls."""
    from pos.process import cudackpt

    if under_pos:
        from floor_gpu import driver_floor

        t = driver_floor(pid)
        return {k: round(v, 3) for k, v in t.items()}
    t: dict[str, float] = {}
    for name, call in (("lock", lambda: cudackpt.lock(pid, 10_000)),
                       ("checkpoint", lambda: cudackpt.checkpoint(pid)),
                       ("restore", lambda: cudackpt.restore(pid)),
                       ("unlock", lambda: cudackpt.unlock(pid))):
        t0 = time.monotonic()
        call()
        t[name] = round(time.monotonic() - t0, 3)
    return t


# ----------------------------------------------------------------------------- the cases

class Bench:
    def __init__(self, out: Path, work: Path, facts: dict[str, Any], disk: dict[str, float]):
        self.out, self.work, self.facts, self.disk = out, work, facts, disk
        self.rows: list[dict[str, Any]] = []
        self.runs: list[dict[str, Any]] = []
        self.req = Requests(work / "requests")
        self.service: Optional[Service] = None
        self.cold_caches = ("dropped", "warm")

    def save(self) -> None:
        (self.out / "serve.json").write_text(json.dumps(
            {"machine": {**self.facts, "disk_read": self.disk}, "rows": self.rows,
             "runs": self.runs}, indent=1, default=str))

    def row(self, model: str, info: dict[str, Any], case: str, cache: str,
            ttft: Optional[float], cold: Optional[float], exact: Optional[bool],
            image_gib: Optional[float] = None, driver: Optional[float] = None,
            split: Optional[dict[str, Any]] = None, **more: Any) -> None:
        r = {"gpu": self.facts["gpu"], "model": model, "params": info["params"],
             "weights_gib": info["weights_gib"], "image_gib": image_gib, "case": case,
             "cache": cache, "ttft_s": None if ttft is None else round(ttft, 3),
             "cold_ttft_s": None if cold is None else round(cold, 3), "exact": exact,
             "disk_read_gbps": self.disk.get("threads_8"), "driver_restore_s": driver,
             "split": split or {}, **more, "date": self.facts["date"],
             "driver": self.facts["driver"], "commit": self.facts["commit"]}
        self.rows.append(r)
        print("row", json.dumps(r), flush=True)
        self.save()

    def full_answer(self, rid: str, n: int = 1) -> list[dict[str, Any]]:
        self.req.ask(rid, FULL_TOKENS) if n == 1 else [self.req.ask(f"{rid}{i}", FULL_TOKENS)
                                                         for i in range(n)]
        if n == 1:
            return self.req.answers(rid)
        return [self.req.answers(f"{rid}{i}")[0] for i in range(n)]

    # -- cold
    def cold(self, model: str, mdir: Path, info: dict[str, Any]) -> dict[str, Any]:
        res: dict[str, Any] = {}
        for cache in self.cold_caches:
            self.req.clear()
            self.req.ask("first", 1)
            if cache == "dropped":
                drop_caches()
            t0 = time.time()
            p = spawn(mdir, self.req, self.out / f"{model}-cold-{cache}.log")
            try:
                first = self.req.answers("first", alive=p)[0]
                ready = self.req.ready()
                full = self.full_answer("full")[0]
            finally:
                kill_pid(p.pid)
                p.wait()
            ttft = first["t_done"] - t0
            res[cache] = {"ttft": ttft, "tokens": full["tokens"]}
            stages = {k: round(ready[k] - t0, 3) for k in ("t_start", "t_imported", "t_loaded",
                                                             "t_warm")}
            exact = full["tokens"] == res["dropped"]["tokens"] if "dropped" in res and \
                cache == "warm" else None
            self.row(model, info, "cold", cache, ttft, ttft, exact, split=stages)
        return res

    # -- an image, restored twice
    def restores(self, model: str, info: dict[str, Any], case: str, image: Path,
                 cold: dict[str, Any], under_pos: bool, ckpt: dict[str, Any]) -> None:
        args, env = VARIANTS.get(case, (("--no-service",), {}))
        image_gib = round(sum(f.stat().st_size for f in image.rglob("*") if f.is_file())
                          / GIB, 2)
        for cache in self.cold_caches:
            self.req.clear()
            self.req.ask("first", 1)
            if cache == "dropped":
                drop_caches()
            run: dict[str, Any] = {"model": model, "case": case, "cache": cache,
                                   "checkpoint": ckpt}
            if case == "concurrent-standby":    # held ready first; the clock starts after
                t0 = time.time()
                run["standby"] = finish(pos_async("restore", "-D", str(image), "--standby",
                                                  env=env), t0)
                if run["standby"]["rc"]:
                    raise RuntimeError(f"pos restore --standby failed: "
                                       f"{run['standby']['err'][-600:]}")
            t0 = time.time()
            p = pos_async("restore", "-D", str(image), "--json", *args, env=env)
            exit_watch(p)
            server = None
            try:
                first = self.req.answers("first", alive=p)[0]
                server = int(first["tag"])
                ttft = first["t_done"] - t0
                full = self.full_answer("full")[0]
                run["restore"] = finish(p, t0)
                # returned while a process of pos's own fills the rest (-detached): when it
                # ended, the server killed only after
                filler = (run["restore"].get("report") or {}).get("filler_pid")
                if filler is not None and case != "concurrent-service":
                    wait_ended(filler)
                    run["filler_ended_s"] = round(time.time() - t0, 3)
                alone = driver_alone(server, under_pos) if cache == "warm" else {}
                run["driver_alone"] = alone
            except Exception as e:
                run["error"] = repr(e)
                if p.poll() is None:
                    p.kill()
                run["restore"] = finish(p, t0)
                self.runs.append(run)
                self.row(model, info, case, cache, None, cold[cache]["ttft"], False, image_gib,
                         error=repr(e)[:300], restore_err=run["restore"].get("err", "")[-600:])
                if server:
                    kill_pid(server)
                continue
            finally:
                if server:
                    kill_pid(server)
            self.runs.append(run)
            rep = run["restore"].get("report") or {}
            tim = rep.get("timings") or {}
            split = {k: round(v, 3) for k, v in tim.items() if isinstance(v, (int, float))}
            split["pos_exit_s"] = run["restore"]["exit_s"]
            # the server's own clock: when it claimed the first request (it is polled every
            # 2 ms), so that the answer's wait splits into the job's resuming and its compute
            split["claimed_s"] = round(first["t_claimed"] - t0, 3)
            if "filler_ended_s" in run:
                split["filler_ended_s"] = run["filler_ended_s"]
            self.row(model, info, case, cache, ttft, cold[cache]["ttft"],
                     full["tokens"] == cold["warm"]["tokens"], image_gib,
                     alone.get("restore") if alone else None, split,
                     driver_alone=alone or None, checkpoint_s=ckpt.get("s"),
                     checkpoint_split=ckpt_split(ckpt),
                     restore_gate=(rep.get("device") or {}).get("gate"))

    def saved(self, model: str, mdir: Path, case: str, prefix: tuple[str, ...],
              args: tuple[str, ...], env: Optional[dict[str, str]] = None
              ) -> tuple[Path, dict[str, Any]]:
        """Start a server (under `prefix`), wait for its warm-up, save it with `pos
        checkpoint ARGS`; the server is gone afterwards."""
        image = self.work / f"{model}-{case}"
        shutil.rmtree(image, ignore_errors=True)
        self.req.clear()
        p = spawn(mdir, self.req, self.out / f"{model}-{case}-server.log", prefix)
        pid = p.pid
        try:
            ready = self.req.ready(p)  # (pos run --clonable: pos checkpoints its job, PID 1
            time.sleep(1.0)            # of the namespaces under the PID it is given; idle)
            memory = host_memory(pid)
            t0 = time.time()
            c = finish(pos_async("checkpoint", str(pid), "-D", str(image), "--json", *args,
                                 env=env), t0)
            c["s"], c["ready"], c["memory"] = c["exit_s"], ready, memory
            if c["rc"]:
                raise RuntimeError(f"pos checkpoint failed: {c['err'][-800:]}")
        finally:
            for q in reversed(procs.tree(p.pid)):
                kill_pid(q)
            p.wait()
        return image, c

    def model(self, model: str, cases: list[str], clones: int) -> None:
        mdir = self.work / model
        info = write_model(model, mdir)
        print(model, json.dumps(info), flush=True)
        cold = self.cold(model, mdir, info)
        variants = [c for c in cases if c in VARIANTS]
        steps = (["stw"] if "stw" in cases else []) + (["concurrent"] if variants else []) + \
            (["notrim"] if "concurrent-notrim" in cases else []) + \
            (["clone"] if "clone" in cases and clones else [])
        for step in steps:
            try:
                if step == "stw":
                    image, c = self.saved(model, mdir, step, (), ())
                    self.restores(model, info, "stw", image, cold, False, c)
                elif step == "concurrent":      # one image, restored by each variant
                    image, c = self.saved(model, mdir, step, (*POS, "run", "--"),
                                          ("--concurrent", "--leave-running"))
                    for case in variants:
                        self.restores(model, info, case, image, cold, True, c)
                elif step == "notrim":          # the baseline of the heap's trim at the hoist
                    image, c = self.saved(model, mdir, step, (*POS, "run", "--"),
                                          ("--concurrent", "--leave-running"),
                                          {"POS_TRIM_HEAP": "0"})
                    self.restores(model, info, "concurrent-notrim", image, cold, True, c)
                else:
                    image, c = self.saved(model, mdir, step,
                                          (*POS, "run", "--clonable", "--"),
                                          ("--concurrent", "--leave-running"))
                    self.clone(model, info, image, cold, clones, c)
                shutil.rmtree(image, ignore_errors=True)
            except Exception as e:
                self.runs.append({"model": model, "case": step, "error": repr(e)})
                self.row(model, info, step, "warm", None, cold["warm"]["ttft"], False,
                         error=repr(e)[:600])

    # -- one image, several instances
    def clone(self, model: str, info: dict[str, Any], image: Path, cold: dict[str, Any],
              n: int, ckpt: dict[str, Any]) -> None:
        self.req.clear()
        for i in range(n):
            self.req.ask(f"first{i}", 1)
        t0 = time.time()
        ps = [pos_async("restore", "-D", str(image), "--to-gpu", str(i), "--json")
              for i in range(n)]
        run: dict[str, Any] = {"model": model, "case": "clone", "instances": n,
                               "checkpoint": ckpt}
        tags: list[int] = []
        try:
            firsts = [self.req.answers(f"first{i}")[0] for i in range(n)]
            tags = sorted({int(a["tag"]) for a in firsts})
            all_answer = max(a["t_done"] for a in firsts) - t0
            fulls = self.full_answer("full", n)
            run["restores"] = [finish(p, t0) for p in ps]
            by_tag = {a["tag"] for a in fulls}
            exact = all(a["tokens"] == cold["warm"]["tokens"] for a in fulls)
            self.runs.append(run)
            self.row(model, info, "clone", "warm", min(a["t_done"] for a in firsts) - t0,
                     cold["warm"]["ttft"], exact and len(tags) == n,
                     instances=n, all_answer_s=round(all_answer, 3),
                     answered_by=len(tags), full_answered_by=len(by_tag),
                     restore_exit_s=[r["exit_s"] for r in run["restores"]],
                     restore_rc=[r["rc"] for r in run["restores"]])
        except Exception as e:
            for p in ps:
                if p.poll() is None:
                    p.kill()
            run["restores"] = [finish(p, t0) for p in ps]
            run["error"] = repr(e)
            self.runs.append(run)
            self.row(model, info, "clone", "warm", None, cold["warm"]["ttft"], False,
                     instances=n, error=repr(e)[:300],
                     restore_err=[r.get("err", "")[-400:] for r in run["restores"]])
        finally:
            for t in tags:
                kill_pid(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/var/tmp/pos-serve")
    ap.add_argument("--models", default="gpt2-large,llama-7b")
    ap.add_argument("--cases", default="stw,concurrent,concurrent-lazy,concurrent-service,clone")
    ap.add_argument("--clones", type=int, default=0, help="instances of the clone case")
    ap.add_argument("--cold", default="dropped,warm",
                    help="the page cache of the cold starts (warm alone for the clone case)")
    ap.add_argument("--service-env", default="",
                    help="NAME=VALUE,... for pos restore-service (e.g. POS_LAZY_PAGES=1)")
    a = ap.parse_args()
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    subreaper()
    facts = machine()
    models = a.models.split(",")
    infos = {m: write_model(m, work / m) for m in models}
    print("weights", json.dumps(infos), flush=True)
    disk = disk_read_gbps(sorted((work / models[-1]).glob("*.safetensors")))
    print("disk", json.dumps(disk), flush=True)
    bench = Bench(out, work, facts, disk)
    bench.cold_caches = tuple(a.cold.split(","))
    cases = a.cases.split(",")
    if "concurrent-service" in cases or "concurrent-standby" in cases:
        env = dict(kv.split("=", 1) for kv in a.service_env.split(",") if kv)
        sock = work / "restore.sock"
        bench.service = Service(sock, out / "restore-service.log", env)
        os.environ["POS_RESTORE_SOCKET"] = str(sock)     # pos restore finds it there
        facts["service_env"] = env
    try:
        for m in models:
            bench.model(m, cases, a.clones)
    finally:
        if bench.service is not None:
            bench.service.stop()


if __name__ == "__main__":
    main()
