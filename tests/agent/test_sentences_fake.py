"""What pos says when a `pos run` job is not where the concurrent engine needs it: ended while
pos was checkpointing it, or not yet using CUDA (its agent starts with its first CUDA call).
Each is one sentence that points the right way, never "start the job with pos run" for a job
that was."""

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.agent.conftest import Job
from tests.conftest import ROOT, wait_for
from tests.engines.conftest import one_sentence, pos


def test_a_pos_run_job_that_has_not_used_cuda_is_told_apart(tmp_path: Path, gpu_env) -> None:
    job = Job(["sh", "-c", "echo READY; exec sleep 300"], tmp_path / "out", gpu_env)
    try:
        r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / "img"), "--concurrent",
                env=gpu_env)
        assert one_sentence(r, 2) == (
            f"Error: process {job.pid} was started with `pos run`, but has not used CUDA yet "
            "(its agent starts with its first CUDA call): checkpoint it once it uses the GPU, "
            "or, until then, without --concurrent.")
        assert job.alive() and not (tmp_path / "img").exists()
    finally:
        job.kill()


def test_a_job_that_ends_during_a_concurrent_checkpoint_is_said_so(
        fill_job, tmp_path: Path, criu_ready, gpu_env) -> None:
    """The job ends while pos is held at the cut (as a job that ends while its memory is pinned
    on a big GPU): the sentence says it ended, at which step, and that nothing was saved."""
    job = fill_job()
    img = tmp_path / "img"
    first = subprocess.Popen([sys.executable, "-m", "pos.cli", "checkpoint", str(job.pid), "-D",
                              str(img), "--concurrent", "--leave-running"], cwd=ROOT,
                             env={**gpu_env, "POS_FAULT_AT": "cut=STOP"},
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    wait_for(lambda: first.poll() is not None or
             open(f"/proc/{first.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "T",
             what="pos to stop at the cut")
    job.kill()
    wait_for(lambda: first.poll() is not None or os.kill(first.pid, signal.SIGCONT),
             timeout=60, what="pos to end", every=0.2)
    _, err = first.communicate(timeout=60)
    lines = err.strip().splitlines()
    assert first.returncode == 1, err
    assert lines[-1] == (f"Error: PID {job.pid} ended while pos was checkpointing it (at step "
                         "cut), so nothing was saved: see how the job ended (its exit status, "
                         "its standard error), and checkpoint a job that runs on."), err
    assert not img.exists() and not Path(f"{img}.partial").exists()


def test_an_agent_socket_held_by_another_process_is_not_talked_to(sleeper, tmp_path: Path,
                                                                 gpu_env) -> None:
    """Any process of the network namespace can take the abstract name of a job's agent before
    the agent does: pos asks the kernel who listens there and talks only to the job itself."""
    import socket

    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(b"\0pos-agent-%d" % sleeper)
    squatter.listen(4)
    try:
        r = pos("checkpoint", str(sleeper), "-D", str(tmp_path / "img"), "--concurrent",
                env=gpu_env)
        assert one_sentence(r, 1) == (
            f"Error: the socket named for process {sleeper}'s agent is held by process "
            f"{os.getpid()}, not by the job, so pos does not talk to it: end that process, then "
            "start the job again with `pos run`.")
        assert not (tmp_path / "img").exists()
    finally:
        squatter.close()
