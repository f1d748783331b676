"""A whole-process concurrent checkpoint whose control connection sits idle while pos sets its
page-locked memory aside (issue 35). pos connects to the agent, asks its status, pins host
memory as large as the job (83-125 GiB on a 4x H200: 20-55 s) and only then sends the cut. On
the H200 the cut's request found the connection gone ("the agent of process N closed its
connection (Broken pipe)", the job running on, no line from the agent on its standard error),
later the larger the job. Here the fake driver's job has the H200 job's buffer count (the 1 GiB
pieces of a 125 GiB job and the model's own) and pos's pin is made as slow as the H200's, so
that each way the idle connection can end (the agent's own limit on a silent pos, and the
job's end of it shut down by other code of the job) happens where it did there."""

import ctypes
import os
import select
import socket
import time
from pathlib import Path
from typing import Callable

import pytest

from pos import concurrent
from pos.agent.control import Agent
from pos.concurrent import gpucopy
from pos.errors import PosError
from pos.operation.engine import Save
from tests.concurrent.test_hook_fake import own
from workloads.fill_job import image_values, torn

BUFFERS = 130          # a 125 GiB job of 1 GiB pieces and the model's own allocations
SYS_PIDFD_GETFD = 438


def connection_fd(pid: int) -> int:
    """The job's end of the agent's control connection: its highest socket descriptor (the
    listening socket comes first, at the agent's start)."""
    socks = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd")
             if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")]
    assert len(socks) >= 2, socks
    return max(socks)


def shut_down_in_job(pid: int, fd: int) -> None:
    """Shut down the socket behind the job's descriptor `fd`, as other code of the job holding
    that number would: the socket ends for the agent too."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        mine = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        assert mine >= 0, os.strerror(ctypes.get_errno())
    finally:
        os.close(pidfd)
    s = socket.socket(fileno=mine)
    s.shutdown(socket.SHUT_RDWR)
    s.close()


def slow_pin(monkeypatch, seconds: float, then: Callable[[], None] = lambda: None) -> None:
    """pos's pin takes `seconds` longer (the H200's 3.4 GiB/s over the job), `then` run in
    the middle of it."""
    pinned = gpucopy.Pinned.__init__

    def pin(self, *a, **k):    # type: ignore[no-untyped-def]
        pinned(self, *a, **k)
        time.sleep(seconds / 2)     # a time, not a wait: the pin's length is what is tested
        then()
        time.sleep(seconds / 2)

    monkeypatch.setattr(gpucopy.Pinned, "__init__", pin)


def test_a_pin_longer_than_the_agents_idle_limit_still_reaches_the_cut(
        fill_job, tmp_path: Path, criu_ready, gpu_env, monkeypatch) -> None:
    """The agent ends a connection on which pos sends nothing for POS_AGENT_STALL_S (60 s; 2
    here), and the pin of a job of 140 GiB or more takes longer than that on the H200."""
    gpu_env["POS_AGENT_STALL_S"] = "2"
    job = fill_job(buffers=BUFFERS)
    slow_pin(monkeypatch, 3.0)
    r = concurrent.checkpoint_full(job.pid, tmp_path / own("img"), Save(leave_running=True))
    assert r.device is not None and r.device.buffers == BUFFERS
    assert not torn(image_values(Path(r.path)))
    assert r.timings["prepare_connection_lost_n"] == 1    # the status's, counted
    assert job.alive()


def test_a_gpu_only_checkpoint_too_reaches_the_cut_after_a_pin_past_the_idle_limit(
        fill_job, tmp_path: Path, gpu_env, monkeypatch) -> None:
    gpu_env["POS_AGENT_STALL_S"] = "2"
    job = fill_job(buffers=BUFFERS)
    slow_pin(monkeypatch, 3.0)
    r = concurrent.checkpoint_gpu(job.pid, tmp_path / "img")
    assert r.device is not None and r.device.buffers == BUFFERS
    assert not torn(image_values(Path(r.path)))
    assert r.timings["prepare_connection_lost_n"] == 1


def test_an_idle_connection_ended_in_the_job_during_the_pin_still_reaches_the_cut(
        fill_job, tmp_path: Path, criu_ready, gpu_env, monkeypatch) -> None:
    """The H200's failure as it looked: the job's end of the idle connection ends while pos
    pins; the agent, idle, takes it for pos's own close and says nothing."""
    job = fill_job(buffers=BUFFERS)
    slow_pin(monkeypatch, 2.0, lambda: shut_down_in_job(job.pid, connection_fd(job.pid)))
    r = concurrent.checkpoint_full(job.pid, tmp_path / own("img"), Save(leave_running=True))
    assert r.device is not None and r.device.buffers == BUFFERS
    assert not torn(image_values(Path(r.path)))
    assert job.alive()


def cut_refused(pid: int, meanwhile: Callable[[Agent], None]) -> str:
    """What pos says when the cut's request finds its connection gone: the connection asked
    the status, then `meanwhile` ran (given the connection)."""
    with Agent(pid) as a:
        a.status()
        meanwhile(a)
        with pytest.raises(PosError) as e:
            a.cut(5)
    return e.value.message


def ended_by_the_agent(a: Agent, timeout: float = 10) -> None:
    """Until the agent ends the connection `a`, on which pos sends nothing (its limit's end:
    the time this takes is what the test is about)."""
    assert select.select([a.sock], [], [], timeout)[0], \
        f"the agent did not end a connection silent for {timeout} s"
    assert a.sock.recv(1, socket.MSG_PEEK) == b"", "the agent said something unasked"


def test_a_connection_ended_by_the_agents_limit_is_named_so(fill_job, gpu_env) -> None:
    """pos says why from what it sees: how long it had been silent, the agent's limit (from the
    job's environment), and the agent's own account, asked on a new connection; it points to
    the job's standard error only where the agent wrote there."""
    gpu_env["POS_AGENT_STALL_S"] = "1"
    job = fill_job(buffers=BUFFERS)
    msg = cut_refused(job.pid, ended_by_the_agent)
    assert "still running" in msg and "after the agent last answered" in msg, msg
    assert "POS_AGENT_STALL_S=1" in msg and "sent nothing for 1 s" in msg, msg
    assert job.alive()


def test_a_connection_ended_in_the_job_is_named_so(fill_job, gpu_env) -> None:
    job = fill_job(buffers=BUFFERS)
    # the cut then meets the shut connection at once; the agent serves one connection at a
    # time, so pos's question on a new one comes only after it recorded how this one ended
    msg = cut_refused(job.pid, lambda _a: shut_down_in_job(job.pid, connection_fd(job.pid)))
    assert "still running" in msg and "the job's end of the connection ended" in msg, msg
    assert "standard error" not in msg, msg         # the agent wrote nothing there
    with Agent(job.pid) as b:                        # and the job can still be checkpointed
        assert b.status().phase == "idle"
