"""POS_CRIU names the CRIU that every engine runs: a wrapper given there is the one that dumps
a `pos run` job concurrently and restores it (the setting travels with the operation's
Settings, not as a bare path)."""

import stat
from pathlib import Path

from pos.process import criu
from tests.engines.conftest import pos
from workloads.fill_job import image_values, torn


def test_the_criu_that_pos_criu_names_dumps_and_restores(fill_job, tmp_path: Path, criu_ready,
                                                         gpu_env) -> None:
    calls = tmp_path / "criu-calls"
    wrapper = tmp_path / "criu"
    wrapper.write_text(f"#!/bin/sh\necho \"$1\" >> {calls}\nexec {criu.find().path} \"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    env = {**gpu_env, "POS_CRIU": str(wrapper)}
    job = fill_job()
    img = tmp_path / "full"
    r = pos("checkpoint", str(job.pid), "-D", str(img), "--concurrent", env=env)
    assert r.returncode == 0, r.stderr
    job.proc.wait(timeout=30)
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    used = calls.read_text().split()
    assert "dump" in used and "restore" in used, used
    assert job.alive() and not torn(image_values(img))
