"""Every `pos` command run by a user other than root: one sentence naming the cause and the fix,
and a non-zero exit, never a traceback; `pos doctor` lists what it could not read."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
from click.testing import CliRunner

from pos import doctor
from pos.cli import cli
from tests.conftest import ROOT, need
from tests.test_cli import _commands

NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all")
ROOT_ONLY = "needs root (CRIU and the driver's checkpoint API need CAP_SYS_ADMIN and " \
            "CAP_CHECKPOINT_RESTORE): run pos with sudo."


@pytest.fixture(scope="module")
def host() -> Iterator[dict[str, str]]:
    """root's store and image (0700, as pos makes them), a folder nobody may write, and two
    sleeping processes: root's and nobody's."""
    need(os.geteuid() == 0 and shutil.which("setpriv") is not None,
         "running pos as another user needs root and setpriv")
    r = subprocess.run([*NOBODY, sys.executable, "-c", "import pos.cli"], cwd=ROOT,
                       capture_output=True, text=True)
    need(r.returncode == 0, f"the checkout must be readable by uid 65534 ({r.stderr.strip()})")
    from pos.store.db import open_db

    base = Path(tempfile.mkdtemp(prefix="pos-nonroot-"))   # pytest's own folders are root's
    base.chmod(0o755)
    private = base / "private"
    private.mkdir(mode=0o700)
    open_db(str(private / "pos.db"))
    (private / "img").mkdir(mode=0o700)
    shared = base / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    roots = subprocess.Popen(["sleep", "600"])
    nobodys = subprocess.Popen([*NOBODY, "sleep", "600"])
    yield {"db": str(private / "pos.db"), "img": str(private / "img"), "shared": str(shared),
           "root_pid": str(roots.pid), "pid": str(nobodys.pid)}
    for p in (roots, nobodys):
        p.kill()
        p.wait()
    shutil.rmtree(base)


def as_nobody(host: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "POS_DB": host["db"], "HOME": host["shared"]}
    return subprocess.run([*NOBODY, sys.executable, "-m", "pos.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=60,
                          stdin=subprocess.DEVNULL)


# each command, its arguments ({} filled from the `host` fixture) and the end of its one line
CASES: dict[tuple[str, ...], list[tuple[tuple[str, ...], str]]] = {
    ("trace",): [(("{root_pid}",), "cannot read the memory map of PID {root_pid} as this "
                                   "user: run pos as root (sudo)."),
                 (("{pid}", "--lib", "/bin/true", "--db", "{shared}/t.db"),
                  "this process lacks CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON: run it with sudo, or "
                  "grant those capabilities.")],
    **{(command,): [(("{db}",), "cannot open the store {db} as this user (Permission denied): "
                                "run pos as root (sudo).")] for command in ("export", "analyze")},
    ("checkpoint",): [(("{pid}", "-D", "{shared}/img"), ROOT_ONLY),
                      (("{pid}", "-D", "{shared}/img", "--concurrent"), ROOT_ONLY)],
    ("restore",): [(("-D", "{img}"), ROOT_ONLY),
                   (("-D", "{img}", "--gpu-only", "{pid}"), ROOT_ONLY)],
    ("restore-service",): [(("--socket", "{shared}/restore.sock"), ROOT_ONLY)],
    ("inspect",): [(("{img}",), "cannot read {img} (images are readable by root only): run pos "
                                "with sudo.")],
    ("migrate",): [(("{pid}", "--to-gpu", "0"), ROOT_ONLY),
                   (("{pid}", "--to", "127.0.0.1:7"), ROOT_ONLY),
                   (("--listen", "-D", "{shared}/in"), ROOT_ONLY)],
    ("daemon",): [((), ROOT_ONLY)],
    **{path: [(args, "pos saves containers of rootful podman only, as root: run pos with sudo.")]
       for path, args in ((("cdi",), ()),
                          (("container", "checkpoint"), ("job", "-D", "{shared}/c")),
                          (("container", "restore"), ("-D", "{shared}", "--name", "copy")))},
    **{path: [(args, "cannot open the store {db} as this user (Permission denied): run pos as "
                     "root (sudo), or give a store of your own with --db or POS_DB.")]
       for path, args in (
           (("schedule", "add"), ("--cron", "* * * * *", "--pid", "{pid}", "-D", "{shared}/s")),
           (("schedule", "ls"), ()), (("schedule", "rm"), ("1",)),
           (("images",), ()), (("images", "ls"), ()), (("images", "prune"), ()))},
}


def test_every_command_is_tried() -> None:
    tried = set(CASES) | {("doctor",), ("run",), ("schedule",), ("container",)}
    assert tried == set(_commands(cli)) - {()}


@pytest.mark.parametrize("path,args,end", [(p, a, e) for p, cases in CASES.items()
                                           for a, e in cases])
def test_one_sentence_and_no_traceback(host, path, args, end) -> None:
    r = as_nobody(host, *path, *(a.format(**host) for a in args))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and last.endswith(end.format(**host)), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_run_needs_no_root(host) -> None:
    r = as_nobody(host, "run", "--", "true")
    assert (r.returncode, r.stderr) == (0, "")


def test_doctor_lists_what_it_could_not_read(host) -> None:
    r = as_nobody(host, "doctor")
    assert r.returncode == 1 and r.stderr == "", r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("MISSING  privileges")
    unread = [ln.split("could not read ")[1].split(" (")[0] for ln in lines
              if ln.startswith("unknown ")]
    if unread:     # tracefs is root's on most hosts
        assert lines[-1] == (f"pos doctor could not read {', '.join(unread)} as this user: run "
                             "it as root (sudo) to check them.")


def test_doctor_goes_on_past_a_file_it_may_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    def denied() -> None:
        raise PermissionError(13, "Permission denied", "/sys/kernel/tracing/uprobe_events")

    monkeypatch.setattr(doctor, "CHECKS", (("tracefs", denied), ("Linux >= 5.8", lambda: None)))
    r = CliRunner().invoke(cli, ["doctor"])
    assert r.exit_code == 1
    assert r.output == (
        "unknown  tracefs: could not read /sys/kernel/tracing/uprobe_events (Permission denied)\n"
        "ok       Linux >= 5.8\n"
        "pos doctor could not read /sys/kernel/tracing/uprobe_events as this user: run it as "
        "root (sudo) to check them.\n")


def test_a_file_no_command_expected_is_one_sentence(monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """The group's last guard: a PermissionError that a command did not expect."""
    from pos.store import images

    def denied(_db: object) -> None:
        raise PermissionError(13, "Permission denied", "/var/lib/pos/x")

    monkeypatch.setattr(images, "list_images", denied)
    r = CliRunner().invoke(cli, ["images", "--db", str(tmp_path / "t.db")])
    assert r.exit_code == 2
    assert r.output == ("Error: pos may not use /var/lib/pos/x, even as root (Permission denied): "
                        "check the permissions of that file and of the file system it is on.\n")
