"""The control socket (permissions, bad requests, root-only peers) and `pos run` (a Python
program with the agent inside, through the fake libcupti of tests/agent/conftest.py; sitecustomize chaining;
POS_RUN_NAME; the plain refusal of other programs)."""

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from pos.agent import HalfRestored, socket_path
from pos.agent.server import Server, handle
from pos.cli import cli
from pos.errors import BadInput
from pos.scheduler import concurrent
from tests.conftest import ROOT


class FakeAgent:
    def status(self) -> dict:
        return {"pid": os.getpid(), "allocations": 0}

    def checkpoint(self, directory, incremental, compress, predicted):  # type: ignore[no-untyped-def]
        raise BadInput(f"{directory} already exists", "give a new directory with -D")

    def restore(self, directory):  # type: ignore[no-untyped-def]
        return {"bytes": 0}


def ask(path: str, text: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        try:
            s.sendall(text + b"\n")
        except BrokenPipeError:       # a refused peer may get its answer before it writes
            pass
        return json.loads(s.makefile("rb").readline())


def test_handle_answers_every_bad_request_in_one_sentence() -> None:
    a = FakeAgent()
    assert handle(a, b"{not json")["error"].startswith("the request is not a JSON object")
    assert handle(a, b"[1]")["ok"] is False
    assert "unknown op 'x'" in handle(a, b'{"op": "x"}')["error"]
    assert handle(a, b'{"op": "checkpoint"}')["error"] == 'checkpoint needs "dir": the image directory.'
    assert handle(a, b'{"op": "checkpoint", "dir": "/d"}')["error"] == \
        "/d already exists: give a new directory with -D."
    assert "bad checkpoint request" in handle(
        a, b'{"op": "checkpoint", "dir": "/d", "predicted": ["zz"]}')["error"]
    assert handle(a, b'{"op": "status"}')["ok"] is True


def test_socket_is_root_only_and_refuses_other_peers(tmp_path: Path) -> None:
    path = str(tmp_path / "agent.sock")
    srv = Server(FakeAgent(), path)
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert ask(path, b'{"op": "status"}')["allocations"] == 0
    finally:
        srv.close()
    assert not os.path.exists(path)
    other = Server(FakeAgent(), path, allowed_uid=12345)
    try:
        assert ask(path, b'{"op": "status"}')["error"].startswith("the pos agent answers root")
    finally:
        other.close()


class HalfRestoringAgent(FakeAgent):
    def restore(self, directory, quick_verify=False):  # type: ignore[no-untyped-def]
        raise HalfRestored("the restore failed after 1 of 2 bytes (chunk 3 is corrupt), so pos "
                           "ended the process", "start the job again")


def test_a_restore_failed_after_the_release_is_answered_then_ends_the_process(
        tmp_path: Path) -> None:
    path = str(tmp_path / "agent.sock")
    ended: list[bool] = []
    srv = Server(HalfRestoringAgent(), path, end=lambda: ended.append(True))
    try:
        assert ask(path, b'{"op": "status"}')["ok"] and not ended
        reply = ask(path, b'{"op": "restore", "dir": "/img", "quick_verify": true}')
        assert reply == {"ok": False, "ended": True, "error": (
            "the restore failed after 1 of 2 bytes (chunk 3 is corrupt), so pos ended the "
            "process: start the job again.")}
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ended == [True]
    finally:
        srv.close()


def test_client_says_plainly_when_there_is_no_agent() -> None:
    with pytest.raises(BadInput, match="has no pos agent"):
        concurrent.status(os.getpid())
    with pytest.raises(BadInput, match="there is no process"):
        concurrent.checkpoint_concurrent(2 ** 22 + 12345, "/tmp/x")


def test_pos_run_refuses_a_program_that_is_not_python() -> None:
    r = CliRunner().invoke(cli, ["run", "--", "/bin/true"])
    assert r.exit_code == 2 and "is not a Python program" in r.output


def test_pos_run_refuses_a_validation_file_that_is_not_a_table(tmp_path: Path) -> None:
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]\n")
    r = CliRunner().invoke(cli, ["run", "--validation", str(junk), "--", sys.executable, "-c", "1"])
    assert r.exit_code == 2
    assert r.output == (f"Error: {junk} is not a validation table: give the JSON file that the "
                        "validator saved.\n")


def test_pos_run_starts_the_agent_and_chains_sitecustomize(tmp_path: Path, fakegpu,  # type: ignore[no-untyped-def]
                                                            fake_cupti: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the agent's socket lives in /run/pos (root)")
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS'] = 'ran'\n")
    prog = tmp_path / "app.py"
    prog.write_text("import os, sys, time\n"
                    "print(os.environ.get('THEIRS'), os.environ.get('POS_RUN_NAME'), flush=True)\n"
                    "sys.stdin.readline()\n")
    env = dict(os.environ, PYTHONPATH=str(theirs), POS_LIBCUPTI=str(fake_cupti),
               POS_LIBCUDA=str(fakegpu["libcuda"]))
    p = subprocess.Popen([str(ROOT / ".venv/bin/pos"), "run", "--name", "job7", "--",
                          sys.executable, str(prog)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().split() == ["ran", "job7"]
        deadline = time.monotonic() + 60
        while not os.path.exists(socket_path(p.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        st = concurrent.status(p.pid)
        assert st["pid"] == p.pid and st["name"] == "job7" and st["cupti"] is True
        assert stat.S_IMODE(os.stat(socket_path(p.pid)).st_mode) == 0o600
        assert stat.S_IMODE(os.stat("/run/pos").st_mode) == 0o700
    finally:
        p.communicate("\n", timeout=30)
    assert p.returncode == 0
    assert not os.path.exists(socket_path(p.pid))


def test_checkpoint_and_restore_reach_the_agent_only_through_their_flags() -> None:
    """`pos checkpoint --concurrent` / `pos restore --gpu-only` talk to the agent; without one
    they say how to start it, and the concurrent-only flags are refused without --concurrent."""
    runner = CliRunner()
    pid = os.getpid()   # a process with no agent socket
    r = runner.invoke(cli, ["checkpoint", str(pid), "-D", "/nonexistent/img", "--incremental"])
    assert r.exit_code == 2 and "--incremental and --compress go with --concurrent" in r.output
    for args in (["checkpoint", str(pid), "-D", "/nonexistent/img", "--concurrent"],
                 ["restore", "-D", "/nonexistent/img", "--gpu-only", str(pid)]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 2, r.output
        assert f"process {pid} has no pos agent" in r.output and "pos run -- CMD" in r.output
        assert "Traceback" not in r.output


def test_pos_run_says_when_another_cupti_tool_holds_the_process(tmp_path: Path, fakegpu,  # type: ignore[no-untyped-def]
                                                                fake_cupti: Path) -> None:
    """CUPTI takes one subscriber: under a profiler the job runs on, without an agent, and
    pos says why in one sentence."""
    prog = tmp_path / "app.py"
    prog.write_text("print('ran', flush=True)\n")
    env = dict(os.environ, POS_LIBCUPTI=str(fake_cupti), POS_LIBCUDA=str(fakegpu["libcuda"]),
               POS_FAKECUPTI_BUSY="1")
    r = subprocess.run([str(ROOT / ".venv/bin/pos"), "run", "--", sys.executable, str(prog)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "ran\n"
    assert r.stderr.strip() == (
        "pos agent: not started: another CUPTI tool (a profiler such as Nsight Systems, "
        "compute-sanitizer or torch.profiler's CUDA tracing) already holds the process's one "
        "CUPTI subscription: run the job under `pos run` without it, or without `pos run` "
        "while profiling.")
