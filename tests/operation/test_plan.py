"""Each operation's plan: what goes to the watchdog comes back as the same plan of the same type,
every type has its undo, and a checkpoint's plan learns the tree as pos found it."""

import json
import os
import signal
import subprocess

import pytest

from pos.operation.plan import KINDS, CheckpointPlan, MovePlan, Plan, RestorePlan, from_json
from pos.operation.watchdog import UNDO, recover
from pos.process import procs
from pos.settings import Settings
from tests.conftest import wait_for


def test_every_plan_comes_back_from_its_json_as_itself() -> None:
    plans: list[Plan] = [
        CheckpointPlan([10, 11], [11], step="dump", images="/img.partial", criu_pid=12,
                       stopped=[10], parent=9, staging="/dev/shm/x", hoisted=True),
        RestorePlan([20], [20], images="/img", work="/tmp/w", gpu_pairs=[["GPU-a", "GPU-b"]],
                    verify=["pages-1.img"], lazy_pid=21, lazy_deadline=5.5),
        MovePlan([30], [30], step="lock"),
    ]
    for plan in plans:
        back = from_json(json.loads(plan.to_json())["plan"])
        assert type(back) is type(plan) and back == plan


def test_every_kind_of_plan_has_its_undo() -> None:
    assert set(KINDS.values()) == set(UNDO)


def test_a_checkpoint_plan_learns_the_tree_as_pos_found_it() -> None:
    running, stopped = (subprocess.Popen(["sleep", "60"]) for _ in range(2))
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        wait_for(lambda: procs.state(stopped.pid) == "T", what="the process stopped")
        plan = CheckpointPlan([running.pid, stopped.pid])
        plan.begin(Settings(criu_wait_s=7.0))
        assert plan.stopped == [stopped.pid] and plan.parent == os.getpid()
        assert plan.criu_wait_s == 7.0
    finally:
        for p in (running, stopped):
            p.kill()
            p.wait()


def test_a_move_without_cuda_undone_leaves_its_processes_running() -> None:
    said: list[str] = []
    assert recover(MovePlan([os.getpid()]), said.append) == "the processes run"
    assert said == []


def test_a_step_that_changes_what_its_plan_lacks_is_refused() -> None:
    """A change the plan's type has no field for would never reach the watchdog."""
    from pos.operation.steps import Guard

    g = Guard(MovePlan([1]), lambda _: None, Settings.from_env({}))
    with pytest.raises(TypeError, match="MovePlan has no staging"):
        g.step("cut", staging="/tmp/x")
