"""`pos restore-service`, and `pos restore` through it: the service says ready on a socket of
root's alone; a bad image or GPU is said as the in-process restore says it, with its exit code;
a stale socket, --no-service and a service that gives no outcome; SIGTERM and SIGINT; a peer
other than root. With real CRIU (root): plain processes restored by the service, two at once,
one whose client went away, one running at SIGTERM, a shell job left to a client on a terminal;
and a `pos run` job on
the fake GPU, whose report says the service ran it and gives the client's start-up, answered
once the job runs (or with --until-filled once its memory is back)."""

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

from pos import concurrent
from pos.image import gpuindex
from pos.operation import oplock
from pos.engines.service_protocol import (Accepted, Echo, Failed, InProcess, Request,
                                            Restored, Running, decode, encode)
from tests.agent.conftest import fill_job, gpu_env, ran_past  # noqa: F401  (fixtures)
from tests.conftest import ROOT, need, wait_for
from tests.engines.conftest import Counter, lines, one_sentence, pos
from tests.test_nonroot import NOBODY
from workloads.fill_job import image_values, torn

SLOW_LINK_US = 6_000_000   # each of the fill's copies to the device: the fill takes 6 s or more
READY = re.compile(r"pos restore-service: ready on (\S+) \((no GPU|GPUs \d+(, \d+)*)\)$")


class Service:
    """`pos restore-service --socket FOLDER/restore.sock`, its output in `log`; started once it
    said it is ready."""

    def __init__(self, folder: Path, log: Path, env: dict[str, str]) -> None:
        self.path, self.out = folder / "restore.sock", log
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pos.cli", "restore-service", "--socket", str(self.path)],
                cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        wait_for(lambda: self.log() or self.proc.poll() is not None, 60, "the service to start")
        assert READY.match(self.log()[0]), self.log()
        self.ready_at = time.monotonic()

    def log(self) -> list[str]:
        return self.out.read_text().splitlines()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The settings of pos's processes: the client's store; the service's logs."""
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
            "POS_LOG_DIR": str(tmp_path / "logs")}


@pytest.fixture
def short() -> Iterator[Path]:
    """A folder of a short path (a unix socket's is at most 107 bytes), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="pos-service-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def service(tmp_path: Path, short: Path, env: dict[str, str]
            ) -> Iterator[Callable[..., Service]]:
    """Start services (`start(env)`), each on a socket in a folder it makes; ended after."""
    need(os.geteuid() == 0, "the restore service needs root")
    started: list[Service] = []

    def start(more: Optional[dict[str, str]] = None) -> Service:
        n = len(started)
        s = Service(short / f"run{n}", tmp_path / f"service{n}.log",
                    {**os.environ, **env, **(more or {})})
        started.append(s)
        return s
    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def through(s: Service, env: dict[str, str]) -> dict[str, str]:
    """A client's environment that names the service's socket."""
    return {**env, "POS_RESTORE_SOCKET": str(s.path)}


def test_the_service_says_ready_on_a_socket_of_root_alone(service, env) -> None:
    s = service()
    assert READY.match(s.log()[0]).group(1) == str(s.path)       # type: ignore[union-attr]
    assert stat.S_ISSOCK(s.path.stat().st_mode) and s.path.stat().st_mode & 0o777 == 0o600
    assert s.path.parent.stat().st_mode & 0o777 == 0o700
    r = pos("restore-service", "--socket", str(s.path), env=env)
    one_sentence(r, 2, f"a restore service already listens on {s.path}: stop it first")
    assert s.proc.poll() is None and s.path.exists()


@pytest.mark.parametrize("args", [("-D", "{missing}"), ("-D", "{empty}"),
                                  ("-D", "{empty}", "--json"), ("-D", "{empty}", "--to-gpu", "7"),
                                  ("-D", "{partial}", "--json")])
def test_a_bad_request_is_said_as_the_restore_here_says_it(service, env, tmp_path: Path,
                                                           args: tuple[str, ...]) -> None:
    """The same sentence (or JSON error) and exit code as the in-process restore; only the
    request without --no-service reaches the service."""
    s = service()
    (tmp_path / "empty").mkdir()
    (tmp_path / "img.partial").mkdir()
    argv = [a.format(missing=tmp_path / "missing", empty=tmp_path / "empty",
                     partial=tmp_path / "img.partial") for a in args]
    served = pos("restore", *argv, env=through(s, env))
    here = pos("restore", *argv, "--no-service", env=through(s, env))
    assert (served.returncode, served.stdout, served.stderr) == \
        (here.returncode, here.stdout, here.stderr)
    if "--json" in argv:
        assert served.returncode == 2 and set(json.loads(served.stdout)) == {"error", "exit"}
    else:
        one_sentence(served, 2)
    wait_for(lambda: len(s.log()) == 2, what=lambda: f"one line for one request: {s.log()}")
    assert s.log()[1].startswith(f"restore of {Path(argv[1]).absolute()}: ")


def test_a_stale_socket_is_said_and_the_restore_runs_here(short: Path, env, tmp_path: Path
                                                          ) -> None:
    need(os.geteuid() == 0, "pos restore needs root")
    sock = short / "restore.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock))            # and nothing listens: the socket of a service that died
    r = pos("restore", "-D", str(tmp_path / "missing"), env={**env,
                                                             "POS_RESTORE_SOCKET": str(sock)})
    one_sentence(r, 2, f"{tmp_path / 'missing'} is not a directory")
    assert r.stdout == (f"the restore service at {sock} does not answer (Connection refused): "
                        "restoring in this process\n")


def one_request(sock: Path, then: Callable[[socket.socket, bytes], None]
                ) -> Callable[[], None]:
    """A stand-in service on `sock` for one connection: it accepts it, reads the request and
    does `then(connection, request line)`; what it returns waits for that, and closes it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(sock))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(encode(Accepted()))
            then(conn, conn.makefile("rb").readline())

    t = threading.Thread(target=serve)
    t.start()

    def done() -> None:
        t.join()
        listener.close()
    return done


def test_a_service_that_gives_no_outcome_is_one_sentence(short: Path, env, tmp_path: Path
                                                         ) -> None:
    """A service that takes the request and ends: the client cannot know whether the job was
    restored, and does not restore it a second time."""
    need(os.geteuid() == 0, "pos restore needs root")
    sock = short / "restore.sock"
    asked: list[bytes] = []
    done = one_request(sock, lambda _conn, request: asked.append(request))
    r = pos("restore", "-D", str(tmp_path / "img"), env={**env, "POS_RESTORE_SOCKET": str(sock)})
    done()
    one_sentence(r, 1, f"the restore service at {sock} gave no outcome for the restore (it "
                 "closed the connection): see the service's log")
    request = decode(asked[0])
    assert isinstance(request, Request) and request.directory == str(tmp_path / "img")
    assert request.started_s is not None and 0 <= request.started_s < 30
    assert not request.terminal and request.to_gpu is None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_removes_the_socket_and_ends_the_service(service, env, tmp_path: Path,
                                                          sig: int) -> None:
    s = service()
    assert s.stop(sig) == 0, s.log()
    assert not s.path.exists()
    r = pos("restore", "-D", str(tmp_path / "missing"), env=through(s, env))
    one_sentence(r, 2, "is not a directory")         # here, and nothing said of a service
    assert r.stdout == ""


def test_a_peer_other_than_root_gets_one_refusal(service, short: Path) -> None:
    need(shutil.which("setpriv") is not None, "connecting as another user needs setpriv")
    s = service()
    for folder in (short, s.path.parent):   # as a host that opened them up would
        folder.chmod(0o755)
    s.path.chmod(0o666)
    read = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); "
            "print(s.makefile().read(), end='')")
    r = subprocess.run([*NOBODY, sys.executable, "-c", read, str(s.path)], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    assert decode(line.encode()) == Failed("the restore service answers root only",
                                           "run pos restore as root (sudo)", 2)


# ---- real CRIU, plain processes --------------------------------------------------------------

def checkpointed(c: Counter, img: Path, env: dict[str, str], *options: str) -> int:
    """`pos checkpoint` of the counter `c` into `img` (which ends it, unless --leave-running);
    how many lines it had counted by then."""
    r = pos("checkpoint", str(c.pid), "-D", str(img), *options, env=env)
    assert r.returncode == 0, r.stderr
    if "--leave-running" not in options:
        c.reap_original()
    return len(lines(c.path))


def test_a_plain_process_is_restored_by_the_service(service, counters, env, tmp_path: Path
                                                    ) -> None:
    s = service()
    c = Counter(tmp_path / "count")
    counters.append(c)
    at_dump = checkpointed(c, tmp_path / "img", env)
    r = pos("restore", "-D", str(tmp_path / "img"), "--json", env=through(s, env))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["served"] is True and report["restored_pid"] == c.pid
    assert report["path"] == str(tmp_path / "img")
    wait_for(lambda: len(lines(c.path)) > at_dump + 10, what="the restored counter")
    assert c.running()
    wait_for(lambda: len(s.log()) == 2, what="the service's line for the restore")
    assert s.log()[1].startswith(f"restored PID {c.pid} from {tmp_path / 'img'}: ")
    images = pos("images", "ls", "--json", env=env)
    (row,) = json.loads(images.stdout)
    assert row["path"] == str(tmp_path / "img") and row["restored_at"] is not None


def test_two_images_restored_at_once(service, counters, env, tmp_path: Path) -> None:
    s = service()
    made = [Counter(tmp_path / f"count{i}") for i in range(2)]
    counters.extend(made)
    at_dump = [checkpointed(c, tmp_path / f"img{i}", env) for i, c in enumerate(made)]
    clients = [subprocess.Popen([sys.executable, "-m", "pos.cli", "restore", "-D",
                                 str(tmp_path / f"img{i}")], cwd=ROOT, text=True,
                                env={**os.environ, **through(s, env)}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for i in range(2)]
    for client, c in zip(clients, made):
        out, err = client.communicate(timeout=120)
        assert client.returncode == 0, err
        said = out.splitlines()        # the restore's lines, then the summary, as here
        assert said[0].startswith(f"restoring PID {c.pid} (python) from ")
        assert said[1].startswith(f"restored PID {c.pid} from ") and len(said) == 4
    for c, n in zip(made, at_dump):
        wait_for(lambda: len(lines(c.path)) > n + 10, what=f"restored counter {c.pid}")
    assert len(s.log()) == 3


def test_a_restore_goes_on_when_its_client_goes_away(service, counters, env, tmp_path: Path
                                                     ) -> None:
    s = service()
    c = Counter(tmp_path / "count")
    counters.append(c)
    at_dump = checkpointed(c, tmp_path / "img", env)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(s.path))
        assert decode(conn.makefile("rb").readline()) == Accepted()
        conn.sendall(encode(Request(str(tmp_path / "img"), None, 0.1, False)))
    wait_for(lambda: len(lines(c.path)) > at_dump + 10, what="the restored counter")
    wait_for(lambda: len(s.log()) == 2, what="the service's line for the restore")
    assert s.log()[1].startswith(f"restored PID {c.pid} ") and "which went away" in s.log()[1]


def test_sigterm_lets_a_running_restore_finish(service, counters, env, tmp_path: Path) -> None:
    s = service()
    c = Counter(tmp_path / "count")
    counters.append(c)
    at_dump = checkpointed(c, tmp_path / "img", env)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(s.path))
        answers = conn.makefile("rb")
        assert decode(answers.readline()) == Accepted()
        conn.sendall(encode(Request(str(tmp_path / "img"), None, 0.1, False)))
        begun = decode(answers.readline())      # the restore's first line: it has begun
        assert isinstance(begun, Echo) and begun.text.startswith(f"restoring PID {c.pid} ")
        s.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: not s.path.exists(), what="the socket to go at once")
        outcome = decode(answers.readline())
    assert isinstance(outcome, Restored) and outcome.report["restored_pid"] == c.pid
    assert s.proc.wait(timeout=60) == 0
    wait_for(lambda: len(lines(c.path)) > at_dump + 10, what="the restored counter")


def test_a_shell_job_asked_for_from_a_terminal_is_left_to_the_client(service, counters, env,
                                                                     tmp_path: Path) -> None:
    """CRIU attaches a shell job to the terminal of its stdin: the client's, which the service
    has not got."""
    s = service()
    c = Counter(tmp_path / "count", shell_job=True)
    counters.append(c)
    checkpointed(c, tmp_path / "img", env, "--shell-job", "--leave-running")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(s.path))
        answers = conn.makefile("rb")
        assert decode(answers.readline()) == Accepted()
        conn.sendall(encode(Request(str(tmp_path / "img"), None, 0.1, True)))
        assert isinstance(decode(answers.readline()), InProcess)
    assert c.running()


# ---- the fake GPU: a `pos run` job's whole-process image -------------------------------------

def saved_job(fill_job, gpu_env: dict[str, str], tmp_path: Path) -> tuple[Any, Path, list[int]]:
    """A `pos run` job of the fake driver, saved concurrently (which ends it): the job, its
    image and the values the image holds."""
    job = fill_job()
    ran_past(job.pid, 0)
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", env=gpu_env)
    assert r.returncode == 0, r.stderr
    job.proc.wait(timeout=30)
    return job, img, image_values(img)


def test_a_pos_run_job_is_restored_with_the_client_s_start_up(service, fill_job, gpu_env,
                                                              tmp_path: Path, criu_ready) -> None:
    """`pos restore` returns once the job runs, its memory still coming back (the service's
    copies to the device made slow): the service fills the rest, and says so in its log once
    it has."""
    s = service({**gpu_env, "POS_FAKECUDA_HTOD_DELAY_US": str(SLOW_LINK_US)})
    assert s.log()[0].endswith("(GPUs 0)")   # the fake driver's one GPU kept warm (CUDA's 0)
    job, img, saved = saved_job(fill_job, gpu_env, tmp_path)
    r = pos("restore", "-D", str(img), "--json", env=through(s, gpu_env))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["served"] is True and report["restored_pid"] == job.pid
    # the client's start-up, not the age of the service (which had waited for the checkpoint)
    assert 0 <= report["timings"]["pos_started_s"] < time.monotonic() - s.ready_at
    # answered at the job's release: the fill's figures are not in yet
    assert report["filling"] is True and report["release_s"] > 0
    assert report["bytes"] == sum(b.size for b in gpuindex.read(img).buffers)
    assert "all_back_at" not in report["timings"] and report["h2d_gbps"] is None
    assert len(s.log()) == 1          # the fill goes on: the service has not said it ended
    with oplock.deletable(img) as free:
        assert not free               # retention leaves the image the fill reads
    wait_for(lambda: len(s.log()) == 2, what="the service's line once the fill has ended")
    assert s.log()[1].startswith(f"restored PID {job.pid} from {img}: ")
    assert s.log()[1].endswith("answered when the job ran)"), s.log()[1]
    with oplock.deletable(img) as free:
        assert free
    ran_past(job.pid, max(saved))
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert not torn(later) and max(later) > max(saved)


def test_until_filled_returns_with_the_fill_s_figures(service, fill_job, gpu_env,
                                                       tmp_path: Path, criu_ready) -> None:
    s = service(gpu_env)
    job, img, saved = saved_job(fill_job, gpu_env, tmp_path)
    r = pos("restore", "-D", str(img), "--until-filled", "--json", env=through(s, gpu_env))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["served"] is True and report["filling"] is False
    assert report["timings"]["all_back_at"] > 0 and report["h2d_gbps"] > 0
    assert report["bytes"] == sum(b.size for b in gpuindex.read(img).buffers)
    ran_past(job.pid, max(saved))


def test_a_pos_run_job_held_ready_has_its_memory_back_before_it_runs(
        service, fill_job, gpu_env, tmp_path: Path, criu_ready) -> None:
    """Held, its processes stopped, while the fill makes and fills its device memory; asked
    for, it runs on from where it was saved."""
    s = service(gpu_env)
    job, img, saved = saved_job(fill_job, gpu_env, tmp_path)
    r = pos("restore", "-D", str(img), "--standby", env=through(s, gpu_env))
    assert r.returncode == 0, r.stderr
    assert _state(job.pid) in ("T", "t")
    r = pos("restore", "-D", str(img), "--json", env=through(s, gpu_env))
    assert r.returncode == 0, r.stderr
    timings = json.loads(r.stdout)["timings"]
    # the fill's memory was all back while the job was held (all_back_at counts from the
    # restore's start, which comes before its tree's, from which the steps count)
    assert timings["all_back_at"] < timings["step_standby_at"] + timings["standby"]
    ran_past(job.pid, max(saved))
    later = image_values(Path(concurrent.checkpoint_gpu(job.pid, tmp_path / "after").path))
    assert not torn(later) and max(later) > max(saved)


def test_the_documented_unit_is_the_shipped_one() -> None:
    unit = (ROOT / "contrib" / "pos-restore.service").read_text()
    docs = (ROOT / "docs" / "checkpoint-restore.md").read_text()
    assert f"```ini\n{unit[unit.index('[Unit]'):]}```" in docs


def test_the_service_keeps_warm_the_gpus_cuda_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA_VISIBLE_DEVICES=0 on a host of two GPUs: the service keeps GPU 0 warm, rather than
    refusing to start; a GPU named with --gpus that CUDA does not see is said."""
    from pos import nvml
    from pos.concurrent import gpucopy
    from pos.engines import service as svc
    from pos.errors import PosError

    seen = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
    hidden = "GPU-bbbbbbbb-0000-0000-0000-000000000002"

    def ordinal(uuid: str) -> int:
        if uuid != seen:
            raise PosError(f"the CUDA driver does not see {uuid}", "check CUDA_VISIBLE_DEVICES")
        return 0

    monkeypatch.setattr(nvml, "available", lambda: True)
    monkeypatch.setattr(nvml, "gpus", lambda: [nvml.Gpu(0, seen, "H200", True),
                                               nvml.Gpu(1, hidden, "H200", True)])
    monkeypatch.setattr(gpucopy, "ordinal", ordinal)
    monkeypatch.setattr(gpucopy, "Context", lambda device: f"context on {device}")
    assert [(w.index, w.context) for w in svc.keep_warm(None)] == [(0, "context on 0")]
    assert [w.index for w in svc.keep_warm((0,))] == [0]
    with pytest.raises(PosError, match="does not see"):
        svc.keep_warm((1,))


# -- restores held ready (pos/engines/standby.py) ---------------------------------------------

def _state(pid: int) -> str:
    """The process's state letter (T: stopped), '' once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _held(s: Service, c: Counter, img: Path, env: dict[str, str]) -> int:
    """The counter `c`'s image `img` held ready by the service `s`: restored, not running;
    how many lines it had counted."""
    at_dump = checkpointed(c, img, env)
    r = pos("restore", "-D", str(img), "--standby", env=through(s, env))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[:2] == [f"restoring PID {c.pid} (python) from {img}",
                                         f"held ready: {img}, restored and checked, its "
                                         "processes stopped"], r.stdout
    assert _state(c.pid) in ("T", "t")
    time.sleep(0.5)     # a time, not a wait: a held job counts nothing in it
    assert len(lines(c.path)) == at_dump      # it does not run
    return at_dump


def test_a_job_held_ready_runs_when_asked_for(service, counters, env, tmp_path: Path) -> None:
    s = service()
    c = Counter(tmp_path / "count")
    counters.append(c)
    img = tmp_path / "img"
    at_dump = _held(s, c, img, env)
    again = pos("restore", "-D", str(img), "--standby", env=through(s, env))
    one_sentence(again, 2, f"{img} is held ready already")
    r = pos("restore", "-D", str(img), "--json", env=through(s, env))
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["served"] is True and report["restored_pid"] == c.pid
    assert report["timings"]["standby"] > 0.5      # how long it was held
    wait_for(lambda: len(lines(c.path)) > at_dump + 10, what="the counter held, then run")
    assert c.running()
    wait_for(lambda: len(s.log()) == 4, what="the service's lines")
    assert s.log()[1].startswith(f"held ready: {img}, ")
    assert s.log()[2].startswith(f"restore of {img}: {img} is held ready already")
    assert s.log()[3].startswith(f"restored PID {c.pid} from {img}: ")


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_a_job_held_ready_ends_with_the_service(service, counters, env, tmp_path: Path,
                                                how: str) -> None:
    """Never left stopped: a service that stops ends the trees it held (which never ran); one
    that dies leaves that to each restore's watchdog."""
    s = service()
    c = Counter(tmp_path / "count")
    counters.append(c)
    _held(s, c, tmp_path / "img", env)
    if how == "stopped":
        assert s.stop() == 0
        assert s.log()[-1] == ("pos restore-service: ended 1 restore(s) held ready, which "
                               "never ran")
    else:
        s.proc.kill()
        s.proc.wait()
    wait_for(lambda: _state(c.pid) in ("", "Z"), 30, "the held tree to end")


def test_standby_needs_the_service(env, tmp_path: Path, short: Path) -> None:
    need(os.geteuid() == 0, "pos restore needs root")
    sock = short / "none.sock"
    r = pos("restore", "-D", str(tmp_path), "--standby",
            env={**env, "POS_RESTORE_SOCKET": str(sock)})
    one_sentence(r, 2, f"no restore service answers on {sock}", "start `pos restore-service`")
    r = pos("restore", "-D", str(tmp_path), "--standby", "--no-service", env=env)
    assert r.returncode == 2 and "--standby is the restore service's" in r.stderr


def test_a_message_with_a_field_this_pos_does_not_know_is_read_without_it() -> None:
    """A pos of another version at the other end: its new fields are left out, not refused."""
    line = (b'{"kind": "Request", "directory": "/img", "to_gpu": null, "started_s": 0.1, '
            b'"terminal": false, "a_later_field": 1}\n')
    assert decode(line) == Request("/img", None, 0.1, False)
    running = Running("/img", {"filling": True}, ["restored PID 1 from /img: 1 MiB"])
    assert decode(encode(running)) == running
