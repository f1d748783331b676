"""Where a job's output goes, and what CRIU's failures become, against real CRIU (root, no GPU).

A job's stdout may be a log file (`>`), a terminal or a pipe: the first two must checkpoint and
restore too. Each known class of CRIU failure ends as one sentence naming the cause and the
fix, exit 2, the job left as it was; a failure of no known class names CRIU's own first error,
never its closing "Restoring FAILED" alone."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pos.image import names
from pos.process import procs
from tests.engines.conftest import (COUNTER, ROOT, Counter, alive, lines, one_sentence, pos,
                                      reap, wait_for)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"POS_DB": str(tmp_path / "pos.db"), "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
            "POS_LOG_DIR": str(tmp_path / "logs")}


def numbers(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split() if x.isdigit()]


@pytest.mark.parametrize("redirect", [">", ">>"])
def test_a_log_that_grew_since_the_dump_is_appended_to(redirect: str, tmp_path: Path, counters,
                                                       env) -> None:
    """stdout and stderr redirected into a log: it grows after a --leave-running dump, and the
    restored job appends to it after what was written since. With `>` (write-only, at an
    offset) pos reopens it for appending; with `>>` (O_APPEND) CRIU itself lets it be."""
    log = tmp_path / "job.log"
    with open(log, "w" if redirect == ">" else "a") as out:
        c = Counter(tmp_path / "count", extra=("--stdout",), stdout=out)
    counters.append(c)
    img = tmp_path / "img"
    r = pos("checkpoint", str(c.pid), "-D", str(img), "--leave-running", env=env)
    assert r.returncode == 0, r.stderr
    at_dump = len(numbers(log))
    wait_for(lambda: len(numbers(log)) > at_dump + 30, what="the log to grow")
    c.proc.kill()
    c.reap_original()
    grown = numbers(log)
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    assert (f"{log} changed since the dump" in r.stdout) == (redirect == ">"), r.stdout
    wait_for(lambda: len(numbers(log)) > len(grown) + 20, what="the restored job's log")
    after = numbers(log)
    assert after[:len(grown)] == grown       # nothing written since the dump was overwritten
    resumed = after[len(grown):]
    assert resumed == list(range(resumed[0], resumed[0] + len(resumed)))
    assert resumed[0] <= grown[-1]           # it went on from the dump's value


def test_a_file_changed_or_gone_since_the_dump_is_named(tmp_path: Path, counters, env) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"\0" * 100)
    c = Counter(tmp_path / "count", extra=("--hold", str(data)))
    counters.append(c)
    img = tmp_path / "img"
    assert pos("checkpoint", str(c.pid), "-D", str(img), env=env).returncode == 0
    c.reap_original()
    data.write_bytes(b"\0" * 150)
    r = pos("restore", "-D", str(img), env=env)
    one_sentence(r, 2, f"the file {data} that PID {c.pid} had open changed size since the "
                 "checkpoint (100 bytes then, 150 now)",
                 f"--inherit-fd 'fd[N]:{str(data).lstrip('/')}'")
    assert not alive(c.pid)                   # refused before CRIU started
    data.unlink()
    one_sentence(pos("restore", "-D", str(img), env=env), 2,
                 f"the file {data} that PID {c.pid} had open is not there any more",
                 "put it back at that path")
    data.write_bytes(b"\0" * 100)             # put back as it was: the restore goes through
    r = pos("restore", "-D", str(img), env=env)
    assert r.returncode == 0, r.stderr
    at = len(lines(c.path))
    wait_for(lambda: len(lines(c.path)) > at + 10, what="the restored counter")


def in_terminal(command: str) -> subprocess.Popen:
    """`command` run by sh on a new pseudo-terminal (script), as from a user's terminal."""
    return subprocess.Popen(["script", "-qec", command, "/dev/null"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True)


def test_a_job_of_a_terminal(tmp_path: Path, criu_ready: None, env) -> None:
    """Started from a terminal, its output on it: checkpoint needs --shell-job; the restore
    attaches it to the terminal `pos restore` runs on, and says so where there is none."""
    if shutil.which("script") is None:
        pytest.skip("script (util-linux) is needed for a pseudo-terminal")
    count, pidfile, img = tmp_path / "count", tmp_path / "pid", tmp_path / "img"
    term = in_terminal(f"echo $$ > {pidfile}; exec {sys.executable} {COUNTER} {count} --stdout")
    try:
        wait_for(lambda: len(lines(count)) > 5, what="the counter on a terminal")
        pid = int(pidfile.read_text())
        assert os.readlink(f"/proc/{pid}/fd/1").startswith("/dev/pts/")
        one_sentence(pos("checkpoint", str(pid), "-D", str(img), env=env), 2, "add --shell-job")
        r = pos("checkpoint", str(pid), "-D", str(img), "--shell-job", env=env)
        assert r.returncode == 0, r.stderr
        term.wait(timeout=20)
        at_dump = len(lines(count))
        one_sentence(pos("restore", "-D", str(img), env=env), 2,
                     "the restore attaches it to the terminal that `pos restore` runs on",
                     "run pos restore on a terminal")
        reap(pid)
        env_args = " ".join(f"{k}={v}" for k, v in env.items())
        term = in_terminal(f"env {env_args} {sys.executable} -m pos.cli restore -D {img} "
                           f"&& sleep 60")
        wait_for(lambda: len(lines(count)) > at_dump + 20, what="the restored counter")
        assert os.readlink(f"/proc/{pid}/fd/1").startswith("/dev/pts/")
        resumed = lines(count)
        assert resumed == list(range(1, len(resumed) + 1))
    finally:
        if pidfile.exists():
            reap(int(pidfile.read_text()))
        os.killpg(term.pid, 9)
        term.wait()


def test_a_missing_external_socket_on_restore(tmp_path: Path, counters, env) -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)   # unread: the
    try:                                                    # socket's buffer holds seconds
        fd = theirs.fileno()
        c = Counter(tmp_path / "count", extra=("--unix-fd", str(fd)), pass_fds=(fd,))
        counters.append(c)
        ino = os.fstat(fd).st_ino
        r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "img"), "--external",
                f"unix[{ino}]", env=env)
        assert r.returncode == 0, r.stderr
        c.reap_original()
        r = pos("restore", "-D", str(tmp_path / "img"), env=env)
        one_sentence(r, 2, "the image holds a UNIX socket that the dump left external",
                     "restore with --inherit-fd 'fd[N]:socket:[INODE]'")
    finally:
        ours.close()
        theirs.close()


def criu_restore(img: Path, work: Path) -> str:
    """CRIU's own restore of `img` (pos's pre-checks bypassed), failing: pos's sentence."""
    from pos.errors import PosError
    from pos.process import criu

    from pos.settings import Settings

    c = criu.find(Settings(log_dir=work.parent / "logs"))
    work.mkdir()
    argv = c.restore_argv(img, criu.Options(), work, work / "pidfile")
    p = c.start(argv)
    with pytest.raises(PosError) as failed:
        c.finish(p, "restore", work / names.RESTORE_LOG)
    return str(failed.value)


def test_pids_in_use_and_an_unknown_failure(tmp_path: Path, counters, env,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """pos refuses a taken PID before CRIU runs; CRIU's own refusal (a PID taken meanwhile)
    is named too. A failure of no known class names CRIU's first error of the failure."""
    c = Counter(tmp_path / "count")
    counters.append(c)
    img = tmp_path / "img"
    assert pos("checkpoint", str(c.pid), "-D", str(img), "--leave-running",
               env=env).returncode == 0
    one_sentence(pos("restore", "-D", str(img), env=env), 2, f"PID {c.pid} of the image is taken")
    said = criu_restore(img, tmp_path / "w1")
    assert said.startswith("criu restore failed: a PID of the image is taken"), said
    broken = tmp_path / "broken"
    shutil.copytree(img, broken)
    next(broken.glob("mm-*.img")).unlink()
    c.proc.kill()
    c.reap_original()
    said = criu_restore(broken, tmp_path / "w2")
    assert said.startswith("criu restore failed: ") and "see CRIU's log" in said, said
    assert "FAILED" not in said, said


def test_a_second_checkpoint_of_a_process_being_checkpointed_is_refused(
        tmp_path: Path, counters, env) -> None:
    """While one pos checkpoints a process (held at its dump step), a second is refused in one
    sentence that names the first, and touches nothing; the first then completes, and the
    counter runs on."""
    import signal

    c = Counter(tmp_path / "count")
    counters.append(c)
    first = subprocess.Popen([sys.executable, "-m", "pos.cli", "checkpoint", str(c.pid), "-D",
                              str(tmp_path / "one"), "--leave-running"], cwd=ROOT,
                             env={**os.environ, **env, "POS_FAULT_AT": "dump=STOP"},
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: procs.state(first.pid) == "T" or first.poll() is not None,
                 what="the first checkpoint to reach its dump")
        assert first.poll() is None, first.communicate()
        r = pos("checkpoint", str(c.pid), "-D", str(tmp_path / "two"), "--leave-running",
                env=env)
        assert one_sentence(r, 2) == (f"Error: PID {c.pid} is being checkpointed by another "
                                      f"pos now (PID {first.pid}): wait for that checkpoint to "
                                      "end, then try again.")
        assert not (tmp_path / "two").exists() and c.running()
    finally:      # the dump step begins twice (before CRIU starts, and as it does): each stops
        wait_for(lambda: first.poll() is not None or os.kill(first.pid, signal.SIGCONT),
                 timeout=120, what="the first checkpoint to end", every=0.2)
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, (out, err)
    at = len(lines(c.path))
    wait_for(lambda: len(lines(c.path)) > at + 3, what="the counter after both")
