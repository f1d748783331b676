"""One image, several instances (issue 36): a job that `pos run --clonable` started in PID and
network namespaces of its own is saved once and restored three times at once, each copy in new
namespaces (real CRIU; no GPU: the GPU part runs in bench/serve_gpu.py's clone case)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pos import host
from pos.image import names
from pos.process import procs
from tests.engines.conftest import ROOT, Counter, lines, one_sentence, pos, wait_for

CLONABLE = (sys.executable, "-m", "pos.cli", "run", "--clonable", "--")


def unshared() -> subprocess.Popen:
    """unshare(1) running `sleep` as PID 1 of new PID and network namespaces."""
    p = subprocess.Popen(["unshare", "--pid", "--net", "--fork", "sleep", "60"],
                         start_new_session=True)
    wait_for(lambda: procs.job_in_namespaces(p.pid) is not None, what="the namespaces")
    return p


def test_a_tree_in_namespaces_of_its_own_is_seen_as_such(criu_ready: None) -> None:
    p = unshared()
    try:
        job = procs.job_in_namespaces(p.pid)
        assert job is not None and job != p.pid
        assert host.ns_pids(job)[-1] == 1 and host.ns_pids(job)[0] == job
        assert procs.own_namespaces([job]) == [1]
        assert procs.own_netns(job) and not procs.own_netns(os.getpid())
        # the wrapper itself is not in them, and a plain process has no such job
        assert procs.own_namespaces([p.pid]) == []
        assert procs.job_in_namespaces(os.getpid()) is None
        assert procs.restored_pids(job, [4242], [1]) == {4242: job}
        assert procs.restored_pids(p.pid, [5, 6], []) == {5: 5, 6: 6}
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_the_options_save_its_network_namespace_empty(criu_ready: None) -> None:
    from pos.process.criu import Options

    p = unshared()
    try:
        job = procs.job_in_namespaces(p.pid)
        assert job is not None
        fitted = Options().fitted([job])
        assert fitted.empty_netns and fitted.argv()[-2:] == ["--empty-ns", "net"]
        assert not Options().fitted([os.getpid()]).empty_netns
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def test_pos_run_clonable_makes_the_job_pid_1_and_passes_its_status_and_signals(
        tmp_path: Path, criu_ready: None) -> None:
    out = tmp_path / "out"
    # its PID written once its handler is in place: PID 1 ignores a signal it has no handler
    # for, and a SIGTERM sent between the two left it asleep
    code = ("import os, signal, sys, time, socket\n"
            "socket.create_server(('127.0.0.1', 0)).close()   # its loopback is up\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
            f"open({str(out)!r}, 'w').write(str(os.getpid()))\n"
            "time.sleep(60)\n")
    p = subprocess.Popen([*CLONABLE, sys.executable, "-c", code], cwd=ROOT,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: out.exists() and out.read_text(), what="the job to start")
        assert out.read_text() == "1"
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=20) == 7
        assert "PID 1 of its own PID and network namespaces" in p.stderr.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.parametrize("lazy", ["0", "1"])     # 1: each copy served by a lazy-pages daemon
def test_one_image_restores_three_times_at_once(tmp_path: Path, counters: list,
                                                lazy: str) -> None:
    c = Counter(tmp_path / "count", prefix=CLONABLE)
    counters.append(c)
    job = procs.job_in_namespaces(c.pid)
    assert job is not None
    img = tmp_path / "img"
    r = pos("checkpoint", str(c.pid), "-D", str(img), "--json")
    assert r.returncode == 0, r.stderr
    assert f"checkpointing the job, PID {job}" in r.stderr
    manifest = json.loads((img / names.MANIFEST).read_text())
    assert manifest["pid"] == job and manifest["inner_pids"] == [1]
    assert manifest["criu_options"]["empty_netns"]
    c.proc.wait(timeout=20)          # the checkpoint ended the job, and so its parent
    before = len(lines(c.path))
    runs = [subprocess.Popen([sys.executable, "-m", "pos.cli", "restore", "-D", str(img),
                              "--json"], cwd=ROOT, stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "POS_LAZY_PAGES": lazy})
            for _ in range(3)]
    restored = []
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        report = json.loads(out.strip().splitlines()[-1])
        restored.append(report["restored_pid"])
        assert ("lazy_done_at" in report["timings"]) == (lazy == "1")
    try:
        assert len(set(restored)) == 3 and job not in restored
        for pid in restored:
            assert procs.alive(pid) and host.ns_pids(pid)[-1] == 1
        assert len({os.stat(f"/proc/{p}/ns/pid").st_ino for p in restored}) == 3
        # all three count on, into the same file: three times as fast as one
        t = time.monotonic()
        wait_for(lambda: len(lines(c.path)) >= before + 150, what="the copies to count")
        assert time.monotonic() - t < 10
    finally:
        procs.kill_tree([q for p in restored for q in procs.tree(p)])
        for pid in restored:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def test_pos_run_clonable_without_root_says_so(tmp_path: Path) -> None:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        *CLONABLE, "true"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "HOME": str(tmp_path)}, timeout=60)
    if "setpriv" in r.stderr and r.returncode != 2:
        pytest.skip(f"setpriv cannot drop privileges here: {r.stderr.strip()}")
    one_sentence(r, 2, "needs root", "leave out --clonable")


def test_a_dead_pos_leaves_no_stopped_copy_behind(tmp_path: Path) -> None:
    """pos died after CRIU restored a copy into new namespaces but before it sent the copy's
    PIDs: the watchdog finds the root in CRIU's pidfile and ends the tree, which never ran."""
    from pos.operation.plan import RestorePlan
    from pos.operation.watchdog import recover

    p = subprocess.Popen(["sleep", "60"], start_new_session=True)
    os.kill(p.pid, signal.SIGSTOP)
    (tmp_path / names.RESTORE_PIDFILE).write_text(f"{p.pid}\n")
    plan = RestorePlan([], [], step="criu-restore", work=str(tmp_path), images="/img")
    said: list[str] = []
    recover(plan, said.append)
    assert p.wait(timeout=10) == -signal.SIGKILL
    assert said and "never ran" in said[0]
    recover(RestorePlan([], [], work=str(tmp_path / "none")), said.append)   # nothing yet
