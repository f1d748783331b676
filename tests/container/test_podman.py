"""GPU jobs in containers (issue 44), with real podman, runc and CRIU and the fake driver in the
container: the agent put in through CDI, a container saved while its job runs and restored
exact, one image restored as four containers at once, a damaged image refused, pos killed
mid-way."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

from pos.agent.control import Agent
from pos.container import ARCHIVE, podman
from pos.image import names
from tests.conftest import ROOT, wait_for
from tests.container.conftest import (BUFFERS, IMAGE, SIZE, ULIMITS, Containers, running,
                                      values)
from tests.engines.conftest import one_sentence, pos
from workloads.fill_job import image_values, torn


def ran_past(c: Containers, name: str, done: int) -> int:
    """Until the job in container NAME has made an operation past its `done`-th."""
    seen = [0]

    def past() -> bool:
        seen[0] = max(values(c.pid(name), held=False))
        return seen[0] > done

    wait_for(past, 20, lambda: f"container {name} to compute past operation {done} "
             f"(at {seen[0]})")
    return seen[0]


def test_the_cdi_spec_puts_the_agent_into_a_container(containers: Containers) -> None:
    r = pos("cdi", "-o", "-")
    spec = json.loads(r.stdout)
    assert spec["kind"] == "pos.dev/agent" and spec["devices"][0]["name"] == "hook"
    name = containers.start()
    pid = containers.pid(name)
    with Agent(pid) as a:          # pos reaches it in the container's network namespace
        st = a.status()
    assert st.pid == 1 and st.owning      # the job is PID 1 in there, its memory the agent's
    assert st.buffers == BUFFERS and st.owned_bytes == BUFFERS * SIZE
    ran_past(containers, name, 0)


def test_a_container_pos_cannot_save_is_refused_in_one_sentence(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    plain = containers.name("plain")          # started without the agent's device
    subprocess.run(["podman", "run", "-d", "--name", plain, *ULIMITS, "-v", "/usr:/usr:ro",
                    IMAGE, "/usr/bin/sleep", "600"], check=True, capture_output=True)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", plain, "-D", str(img), env=gpu_env)
    one_sentence(r, 2, f"container {plain} has no pos agent", "--device pos.dev/agent=hook")
    assert running(plain) and not img.exists()
    r = pos("container", "checkpoint", containers.name("none"), "-D", str(img), env=gpu_env)
    one_sentence(r, 2, "podman has no container")
    r = pos("container", "restore", "-D", str(tmp_path), "--name", plain, env=gpu_env)
    one_sentence(r, 2)


def test_a_running_container_is_saved_while_it_runs_and_restored(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    name = containers.start()
    done = ran_past(containers, name, 0)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), "--leave-running", "--json",
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    saved = image_values(img)
    assert not torn(saved) and max(saved) > done     # an exact cut, taken while it ran
    assert report["engine"] == "concurrent" and report["bytes"] == BUFFERS * SIZE
    assert (img / ARCHIVE).is_file()
    assert running(name)
    ran_past(containers, name, max(saved))           # the original computes on
    assert one_sentence(pos("restore", "-D", str(img), env=gpu_env), 2) == (
        f"Error: {img} is the image of a container: restore it with `pos container restore -D "
        f"{img} --name NEW`.")

    copy = containers.name("copy")                   # beside the original, still running
    r = pos("container", "restore", "-D", str(img), "--name", copy, env=gpu_env)
    assert r.returncode == 0, r.stderr
    made = containers.hold(copy)
    now = values(containers.pid(copy))
    assert not torn(now) and max(now) == made >= max(saved)   # on from where it was saved
    containers.go_on(copy)
    ran_past(containers, copy, made)
    assert running(name)
    ran_past(containers, name, max(saved))


def test_one_image_restores_as_four_containers_at_once_each_exact(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    """The job paused before the checkpoint, so each copy can be read before it moves: every
    copy holds the image's buffers bit for bit, then computes on from there."""
    name = containers.start()
    ran_past(containers, name, 0)
    made = containers.hold(name)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert not running(name)                         # without --leave-running: stopped
    saved = image_values(img)
    assert max(saved) == made and not torn(saved)

    copies = [containers.name(f"copy{i}") for i in range(4)]
    procs = [subprocess.Popen([sys.executable, "-m", "pos.cli", "container", "restore", "-D",
                               str(img), "--name", c], cwd=ROOT, env=gpu_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in copies]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    pids = [containers.pid(c) for c in copies]
    assert len(set(pids)) == 4
    for c, pid in zip(copies, pids):
        assert running(c)
        assert values(pid) == saved, c               # bit-exact, each one
    for c in copies:
        containers.go_on(c)
    for c in copies:
        again = ran_past(containers, c, made)
        assert again > made


def test_a_damaged_image_is_refused_in_one_sentence(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    name = containers.start()
    containers.hold(name)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    with open(img / ARCHIVE, "r+b") as f:       # one byte of podman's export flipped
        f.seek(os.path.getsize(img / ARCHIVE) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    copy = containers.name("copy")
    r = pos("container", "restore", "-D", str(img), "--name", copy, env=gpu_env)
    one_sentence(r, 2, "corrupt", ARCHIVE)
    assert not podman.exists(copy)
    r = pos("container", "restore", "-D", str(tmp_path), "--name", copy, env=gpu_env)
    one_sentence(r, 2)
    assert not podman.exists(copy)


def test_damaged_gpu_memory_leaves_no_container_behind(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    """The GPU data's chunks are checked as they are read, after podman made the container:
    the failure then removes it."""
    name = containers.start()
    containers.hold(name)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    data = sorted(p for p in img.iterdir() if names.is_gpu_data(p.name))[0]
    with open(data, "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 64)
    copy = containers.name("copy")
    # no driver on this host: said before podman makes anything
    r = pos("container", "restore", "-D", str(img), "--name", copy,
            env={**gpu_env, "POS_LIBCUDA": str(tmp_path / "none" / "libcuda.so.1")})
    one_sentence(r, 1, "libcuda.so.1 could not be loaded")
    assert not podman.exists(copy)
    r = pos("container", "restore", "-D", str(img), "--name", copy, env=gpu_env)
    one_sentence(r, 2, "does not match its checksum")
    assert not podman.exists(copy)


def _kill_pos_at(step_seen: str, argv: list[str], env: dict[str, str]) -> None:
    """pos ARGV killed (SIGKILL) as soon as it is at `step_seen`: 'podman' while podman runs,
    else a step of the engine's (POS_FAULT_AT)."""
    argv = [sys.executable, "-m", "pos.cli", *argv]
    if step_seen != "podman":
        r = subprocess.run(argv, cwd=ROOT, env={**env, "POS_FAULT_AT": f"{step_seen}=KILL"},
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)
        return
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    found = threading.Event()

    def podman_child() -> bool:
        kids = Path(f"/proc/{p.pid}/task/{p.pid}/children")
        for k in kids.read_text().split() if kids.exists() else []:
            if Path(f"/proc/{k}/comm").read_text().strip() == "podman":
                found.set()
        return found.is_set() or p.poll() is not None

    wait_for(podman_child, 60, "pos to start podman", every=0.002)
    p.kill()
    p.wait()
    assert found.is_set(), "pos ended before it started podman"


def test_pos_killed_mid_way_leaves_the_container_running(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    name = containers.start()
    done = ran_past(containers, name, 0)
    for i, step in enumerate(("cut", "hoist", "dump", "podman", "copy", "seal")):
        _kill_pos_at(step, ["container", "checkpoint", name, "-D", str(tmp_path / f"img{i}"),
                            "--leave-running"], gpu_env)
        # the watchdog gives the job its memory back: it computes on, in a running container
        wait_for(lambda: running(name), 30, f"container {name} running after pos died at {step}")
        done = ran_past(containers, name, done)
        assert not (tmp_path / f"img{i}").exists()
    # and it can be saved again
    r = pos("container", "checkpoint", name, "-D", str(tmp_path / "last"), "--leave-running",
            env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert not torn(image_values(tmp_path / "last"))


def test_pos_killed_while_restoring_leaves_no_container(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    """podman's restore runs the container's processes at once, their device memory not back:
    pos killed then, or later, must not leave that container running."""
    name = containers.start()
    made = containers.hold(name)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    for step in ("podman", "remap", "fill"):
        copy = containers.name(f"copy-{step}")
        _kill_pos_at(step, ["container", "restore", "-D", str(img), "--name", copy], gpu_env)
        wait_for(lambda: not podman.exists(copy), 30, f"container {copy} to go ({step})")
    # the image is whole: it restores
    copy = containers.name("copy")
    r = pos("container", "restore", "-D", str(img), "--name", copy, env=gpu_env)
    assert r.returncode == 0, r.stderr
    assert values(containers.pid(copy)) == image_values(img) and max(image_values(img)) == made


def test_a_runtime_that_fails_its_checkpoint_leaves_the_container_running(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    """podman's checkpoint failing at pos's step dump, the job's memory hoisted and its driver
    checkpointed: a `criu` first on pos's PATH (podman inherits it) that refuses `criu swrk`,
    the service podman asks CRIU's version of first ("checkpoint/restore requires at least
    CRIU 31100"). pos says so in one sentence and undoes its part: the container runs on,
    its job computing, and can be saved after."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = shutil.which("criu")
    assert real is not None
    (bin_dir / "criu").write_text(f'#!/bin/sh\n[ "$1" = swrk ] && exit 1\nexec {real} "$@"\n')
    (bin_dir / "criu").chmod(0o755)
    name = containers.start()
    done = ran_past(containers, name, 0)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), "--leave-running",
            env={**gpu_env, "PATH": f"{bin_dir}:{gpu_env['PATH']}"})
    one_sentence(r, 1, "`podman container checkpoint` failed", "CRIU")
    assert running(name) and not img.exists()
    ran_past(containers, name, done)
    r = pos("container", "checkpoint", name, "-D", str(img), "--leave-running", env=gpu_env)
    assert r.returncode == 0, r.stderr


def test_an_image_restores_after_pos_cdi_installed_another_agent(
        containers: Containers, tmp_path: Path, gpu_env: dict[str, str]) -> None:
    """CRIU restores a mapped file only if it is the one of the dump: each agent pos cdi
    installs is a file of its own, kept, so that a newer agent leaves older images whole."""
    from pos.agent.hook import build
    from pos.container import cdi

    name = containers.start()
    made = containers.hold(name)
    img = tmp_path / "img"
    r = pos("container", "checkpoint", name, "-D", str(img), env=gpu_env)
    assert r.returncode == 0, r.stderr
    newer = tmp_path / "libposhook.so"         # another agent: other bytes, another size
    newer.write_bytes(Path(build()).read_bytes() + b"\0" * 4096)
    installed = cdi.install_library(newer)
    try:
        cdi.write(cdi.SPEC, installed)
        assert json.loads(cdi.SPEC.read_text())["devices"][0]["containerEdits"]["mounts"][0][
            "hostPath"] == str(installed)
        copy = containers.name("copy")
        r = pos("container", "restore", "-D", str(img), "--name", copy, env=gpu_env)
        assert r.returncode == 0, r.stderr
        assert values(containers.pid(copy)) == image_values(img)
        assert max(image_values(img)) == made
    finally:
        assert pos("cdi").returncode == 0       # the agent of this pos again
        installed.unlink(missing_ok=True)
