"""A driver entry point that touches device memory and that the agent's gate does not know
(hook/gated.h), looked up by the job or linked to: pos takes no cut of it, for a checkpoint or
a refill, and says so in one sentence; the job runs on. The fake driver's cuMemcpyFutureAsync stands for
the copy of a driver newer than pos."""

from pathlib import Path

import pytest

from pos.agent.control import Agent, Refused
from pos.scheduler import concurrent
from tests.agent.conftest import ran_past
from tests.scheduler.conftest import one_sentence, pos

FUTURE = "cuMemcpyFutureAsync"


def test_a_job_that_looked_up_an_unknown_copy_is_neither_cut_nor_refilled(
        fill_job, tmp_path: Path, criu_ready, gpu_env: dict[str, str]) -> None:
    known = fill_job()
    image = Path(concurrent.checkpoint_gpu(known.pid, tmp_path / "known").path)
    job = fill_job(copy=FUTURE)
    with Agent(job.pid) as a:
        assert a.status().ungated == FUTURE
    done = ran_past(job.pid)
    for how in (["--gpu-only"], ["--leave-running"]):
        img = tmp_path / f"img{len(how[0])}"
        r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", *how, env=gpu_env)
        one_sentence(r, 1, f"pos cannot checkpoint or restore process {job.pid} while it runs: "
                     f"it can call {FUTURE}, a driver entry point that reads or writes device "
                     "memory", "update pos")
        assert not img.exists()
    with pytest.raises(Refused) as refused:
        concurrent.restore_gpu(job.pid, image)
    assert refused.value.ungated == FUTURE
    with Agent(job.pid) as a:
        st = a.status()
    assert st.phase == "idle" and st.gate.held == 0
    ran_past(job.pid, done)            # it computes on, its copies through FUTURE too
    assert job.alive() and known.alive()


def test_a_job_that_links_to_an_unknown_copy_is_not_cut(
        fill_job, tmp_path: Path, criu_ready, gpu_env: dict[str, str]) -> None:
    """Linked, not looked up: the agent reads what the job's objects link to at the cut."""
    job = fill_job(linked=True)
    with Agent(job.pid) as a:
        assert a.status().ungated == ""     # no lookup of it: the cut reads the links
    done = ran_past(job.pid)
    r = pos("checkpoint", str(job.pid), "-D", str(tmp_path / "img"), "--concurrent",
            "--leave-running", env=gpu_env)
    one_sentence(r, 1, f"it can call {FUTURE}", "update pos")
    assert not (tmp_path / "img").exists()
    with Agent(job.pid) as a:
        st = a.status()
    assert st.ungated == FUTURE and st.phase == "idle" and st.gate.held == 0
    ran_past(job.pid, done)
