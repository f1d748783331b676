"""A driver entry point that touches device memory and that the agent's gate does not know
(hook/gated.h), looked up by the job or linked to: pos takes no cut of it, for a checkpoint or
a refill, and says so in one sentence; the job runs on. The fake driver's cuMemcpyFutureAsync
stands for the copy of a driver newer than pos."""

from pathlib import Path

import pytest

from pos.agent.control import Agent, Refused
from pos import concurrent
from pos.image.opened import open_image
from tests.agent.conftest import ran_past
from tests.conftest import wait_for
from tests.engines.conftest import one_sentence, pos

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
        concurrent.restore_gpu(job.pid, open_image(image))
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


def test_a_lookup_made_while_the_job_is_held_waits_for_the_operation_to_end(
        fill_job, tmp_path: Path) -> None:
    """The job may call what it looked up at once: the lookup waits in the gate as a call that
    may touch every buffer, and the next cut is refused."""
    trigger = tmp_path / "look-up"
    job = fill_job(copy=FUTURE, copy_when=trigger)
    job.hold()
    with Agent(job.pid) as a:
        a.cut(10.0)
        trigger.touch()
        job.pause.unlink()                 # its next operation looks FUTURE up first
        # the lookup is recorded, then waits in the gate: ended between the two, the operation
        # would have nothing to hold
        wait_for(lambda: (st := a.status()).ungated == FUTURE and st.waiting == 1, 10,
                 f"the job's lookup of {FUTURE} to wait in the gate")
        assert "LOOKED UP" not in job.out.read_text()     # held with every other call
        gate = a.end()
    assert FUTURE in [w.what for w in gate.waits], gate
    job.printed("LOOKED UP")
    with Agent(job.pid) as a, pytest.raises(Refused) as refused:
        a.cut(10.0)
    assert refused.value.ungated == FUTURE
    ran_past(job.pid)
