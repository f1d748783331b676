"""Bad input to checkpoint/restore: one sentence naming the cause and the fix, exit 2, no
traceback, the target untouched and nothing half-written left looking complete."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pos.image import names
from tests.conftest import need
from tests.engines.conftest import COUNTER, Counter, lines, one_sentence, pos, wait_for


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log")}


@pytest.fixture
def counter(tmp_path: Path, counters) -> Counter:
    c = Counter(tmp_path / "count")
    counters.append(c)
    return c


def test_no_such_pid(tmp_path, criu_ready, env) -> None:
    r = pos("checkpoint", "4000000", "-D", str(tmp_path / "img"), env=env)
    assert one_sentence(r, 2) == ("Error: no process has PID 4000000: give the PID of a running "
                                  "process.")


def kernel_thread() -> int:
    """A kernel thread's PID (kthreadd is 2 only where this PID namespace is the host's)."""
    from pos.process import procs

    pids = sorted(int(d.name) for d in Path("/proc").iterdir() if d.name.isdigit())
    found = [pid for pid in pids if procs.is_kernel_thread(pid)]
    if not found:   # a property of where the suite runs, not a missing prerequisite
        pytest.skip("no kernel thread is visible in this PID namespace")
    return found[0]


@pytest.mark.parametrize("pid,what", [(1, "init"), (None, "a kernel thread")])
def test_pid_that_cannot_be_checkpointed(tmp_path, criu_ready, env, pid, what) -> None:
    pid = pid or kernel_thread()
    one_sentence(pos("checkpoint", str(pid), "-D", str(tmp_path / "img"), env=env), 2,
                 f"PID {pid} is {what}")


def test_pid_of_pos_itself(tmp_path, criu_ready, env) -> None:
    # pytest is an ancestor of the pos it starts
    one_sentence(pos("checkpoint", str(os.getpid()), "-D", str(tmp_path / "img"), env=env), 2,
                 "is pos itself or one of its parents")


def test_caller_without_privileges(tmp_path, counter, env) -> None:
    need(shutil.which("setpriv") is not None, "dropping privileges needs setpriv")
    tmp_path.chmod(0o777)
    r = pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "img"), env=env,
            prefix=("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                    "--inh-caps=-all"))
    one_sentence(r, 2, "needs root", "sudo")
    assert counter.running()


@pytest.mark.parametrize("to", ["", ":7070", "host:0", "host:65535", "host:http"])
def test_migrate_to_what_is_not_host_port(env, to: str) -> None:
    r = pos("migrate", str(os.getpid()), "--to", to, env=env)
    assert one_sentence(r, 2) == (f"Error: --to {to!r} is not HOST or HOST:PORT (a port from 1 "
                                  "to 65534): e.g. --to 10.0.0.2:7070.")


def test_directory_exists_or_parent_missing(tmp_path, counter, env) -> None:
    (tmp_path / "img").mkdir()
    one_sentence(pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "img"), env=env), 2,
                 "already exists")
    one_sentence(pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "no" / "img"),
                     env=env), 2, "does not exist")
    (tmp_path / "afile").write_text("")
    r = pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "afile" / "sub" / "img"),
            env=env)
    assert one_sentence(r, 2) == (f"Error: {tmp_path / 'afile'} is a file, not a folder: give -D "
                                  "a path under a folder.")
    assert counter.running()


@pytest.fixture
def small_mount(tmp_path: Path):
    """A 1 MiB tmpfs (read-only when asked): out of space, or not writable even for root."""
    mounted = []

    def make(options: str) -> Path:
        d = tmp_path / f"mnt{len(mounted)}"
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "pos-test", str(d)], check=True)
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", str(d)], check=False)


def test_directory_not_writable(counter, env, small_mount) -> None:
    d = small_mount("ro,size=1m")
    one_sentence(pos("checkpoint", str(counter.pid), "-D", str(d / "img"), env=env), 2,
                 "is not writable")
    assert counter.running() and not any(d.iterdir())


def test_out_of_space(counter, env, small_mount) -> None:
    d = small_mount("size=1m")
    one_sentence(pos("checkpoint", str(counter.pid), "-D", str(d / "img"), env=env), 2,
                 "MiB free and the image needs about", "free space")
    assert counter.running() and not any(d.iterdir())


def test_restore_whose_pid_is_taken(tmp_path, counter, env) -> None:
    img = tmp_path / "img"
    assert pos("checkpoint", str(counter.pid), "-D", str(img), "--leave-running",
               env=env).returncode == 0
    one_sentence(pos("restore", "-D", str(img), env=env), 2,
                 f"PID {counter.pid} of the image is taken", "stop that process")
    assert counter.running()


def test_restore_of_something_else(tmp_path, criu_ready, env) -> None:
    one_sentence(pos("restore", "-D", str(tmp_path), env=env), 2, "is not a complete pos image")
    one_sentence(pos("restore", "-D", str(tmp_path / "nothing"), env=env), 2,
                 "is not a directory")


def test_session_begun_outside_its_pid_namespace(tmp_path, criu_ready, env) -> None:
    """A container's first process that never called setsid: --shell-job cannot help, a
    session of its own does (CI itself may run so)."""
    from pos.process import procs

    count = tmp_path / "count"
    outer = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable,
                              str(COUNTER), str(count)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(lines(count)) >= 5, what="the counter")
        pid = procs.tree(outer.pid)[1]
        r = pos("checkpoint", str(pid), "-D", str(tmp_path / "img"), "--shell-job", env=env)
        one_sentence(r, 2, "started outside its PID namespace", "not even with --shell-job",
                     "setsid COMMAND")
        before = len(lines(count))
        wait_for(lambda: len(lines(count)) > before + 5, what="the counter to go on")
        assert not (tmp_path / "img").exists()
    finally:
        outer.kill()
        outer.wait()


def test_missing_criu(tmp_path, counter, env) -> None:
    r = pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "img"),
            env={**env, "POS_CRIU": "/nonexistent/criu"})
    one_sentence(r, 2, "POS_CRIU=/nonexistent/criu does not run as CRIU", "scripts/setup.sh")
    assert counter.running()


def test_old_criu_is_refused(tmp_path, counter, env) -> None:
    old = tmp_path / "criu"
    old.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    old.chmod(0o755)
    one_sentence(pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "img"),
                     env={**env, "POS_CRIU": str(old)}), 2, "is CRIU 3.17.1, pos needs >= 4.0")


def test_bad_store_is_refused_before_the_process_is_touched(tmp_path, counter, env) -> None:
    """Without --leave-running the dump ends the process: a --db that cannot take the image's
    row must be refused before that, not after."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a SQLite file" * 100)
    r = pos("checkpoint", str(counter.pid), "-D", str(tmp_path / "img"), "--db", str(junk),
            env=env)
    one_sentence(r, 2, "junk.db")
    assert counter.running()
    assert not (tmp_path / "img").exists() and not names.partial(tmp_path / "img").exists()
    r = pos("restore", "-D", str(tmp_path / "img"), "--db", str(junk), env=env)
    one_sentence(r, 2, "junk.db")


def test_a_manifest_of_bytes_that_are_not_utf8_is_refused_in_one_sentence(tmp_path, env) -> None:
    """`pos restore` and `pos inspect` (and their --json) on an image whose manifest is not text:
    one sentence, exit 2; with --json one JSON object on stdout."""
    import json

    img = tmp_path / "img"
    img.mkdir()
    (img / names.MANIFEST).write_bytes(b'{"pid": 1, "comm": "\xff\xfe\x80"}')
    want = (f"Error: {img / names.MANIFEST} is not a valid pos manifest: the image is corrupt: "
            "take a new checkpoint.")
    for args in (("restore", "-D", str(img)), ("inspect", str(img))):
        assert one_sentence(pos(*args, env=env), 2) == want
        r = pos(*args, "--json", env=env)
        assert r.returncode == 2, (r.stdout, r.stderr)
        assert json.loads(r.stdout) == {"error": want.removeprefix("Error: "), "exit": 2}
