"""pos/process/kdat.py with the real CRIU, as root: where /run is not a tmpfs, the cache pos
keeps is the one CRIU loads (its log says so) and no CRIU run probes the kernel again; one made
for another CRIU replaces it, never stacks on it; a CRIU that keeps none is asked once; where
/run is a tmpfs, pos leaves the cache to CRIU. Each case runs in a child process in a mount
namespace of its own, whose /run is a folder of the test's: the host's /run is never touched."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from pos import host
from pos.process import kdat
from tests.conftest import ROOT, need

CHILD = r'''
import json, os, subprocess, sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pos import host
from pos.process import criu, kdat

folder, run_kind, other, together = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
host.own_mounts()
if run_kind == "tmpfs":
    host.mount_tmpfs(Path("/run"), b"mode=0755")
else:
    host.bind_mount(folder / "run", Path("/run"))
def mount_points():
    return Counter(line.split()[4] for line in open("/proc/self/mountinfo"))


before = mount_points()      # the host's, /run/criu.kdat among them where pos keeps one there
c = criu.find()
out = {"states": [], "reasons": []}
if together > 1:             # pos's processes at once: threads, each with its own lock's open
    with ThreadPoolExecutor(together) as pool:
        kept = list(pool.map(lambda _: kdat.keep(c.path, c.version_text), range(together)))
    out["together"] = sorted(k.state.value for k in kept)
for path in (c.path, c.path, *([other, other] if other else [])):
    kept = kdat.keep(path, c.version_text)
    out["states"].append(kept.state.value)
    out["reasons"].append(kept.reason)
sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
img = folder / "img"
img.mkdir()
out["rc"] = subprocess.run([other or c.path, "dump", "-t", str(sleeper.pid), "-D", str(img),
                            "-o", "log", "-v4", "--leave-running"]).returncode
out["log"] = (img / "log").read_text() if (img / "log").exists() else ""
sleeper.kill()
out["mounts"] = list((mount_points() - before).elements())     # those pos made
print(json.dumps(out))
'''


@pytest.fixture
def folder(tmp_path: Path) -> Iterator[Path]:
    """A folder of the test's on a file system that is not a tmpfs, its `run` to stand for
    /run."""
    for base in (tmp_path, Path("/var/tmp"), ROOT):
        if host.fs_magic(base) != host.TMPFS_MAGIC:
            made = Path(os.path.realpath(base)) / f"kdat-{os.getpid()}-{tmp_path.name}"
            (made / "run").mkdir(parents=True)
            yield made
            shutil.rmtree(made, ignore_errors=True)
            return
    need(False, "no folder off a tmpfs to stand for /run")


def child(folder: Path, run_kind: str = "disk", other: str = "", together: int = 1
          ) -> dict[str, Any]:
    """CHILD's findings: keep() twice for pos's CRIU (first `together` at once), then twice
    for `other` if given, with /run on `run_kind`; then a dump by the last CRIU."""
    p = subprocess.run([sys.executable, "-c", CHILD, str(folder), run_kind, other,
                        str(together)],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    out: dict[str, Any] = json.loads(p.stdout.splitlines()[-1])
    return out


def test_criu_loads_the_cache_pos_keeps_where_run_is_not_a_tmpfs(criu_ready,
                                                                 folder: Path) -> None:
    out = child(folder)
    assert out["states"] == ["made", "kept"], out["reasons"]
    assert out["rc"] == 0, out["log"][-2000:]
    assert "Loaded kdat cache from /run/criu.kdat" in out["log"]
    assert out["mounts"].count("/run/criu.kdat") == 1
    assert out["mounts"].count(str(kdat.ROOT)) == 1


def test_made_once_when_several_ask_at_once(criu_ready, folder: Path) -> None:
    out = child(folder, together=4)
    assert out["together"] == ["kept", "kept", "kept", "made"]
    assert out["mounts"].count("/run/criu.kdat") == 1
    assert out["mounts"].count(str(kdat.ROOT)) == 1
    assert out["rc"] == 0 and "Loaded kdat cache from /run/criu.kdat" in out["log"]


def test_a_cache_for_another_criu_replaces_the_one_there(criu_ready, folder: Path) -> None:
    from pos.process import criu

    wrapper = folder / "criu"       # another CRIU to pos: another file that runs CRIU
    wrapper.write_text(f"#!/bin/sh\nexec {criu.find().path} \"$@\"\n")
    wrapper.chmod(0o755)
    out = child(folder, other=str(wrapper))
    assert out["states"] == ["made", "kept", "made", "kept"], out["reasons"]
    assert out["rc"] == 0 and "Loaded kdat cache from /run/criu.kdat" in out["log"]
    assert out["mounts"].count("/run/criu.kdat") == 1      # replaced, not stacked


def test_a_criu_that_keeps_no_cache_is_asked_once(criu_ready, folder: Path) -> None:
    calls = folder / "calls"
    fake = folder / "criu"
    fake.write_text(f"#!/bin/sh\necho \"$1\" >> {calls}\necho 'no cache here' >&2\nexit 1\n")
    fake.chmod(0o755)
    out = child(folder, other=str(fake))
    assert out["states"] == ["made", "kept", "failed", "failed"]
    assert "kept no cache: no cache here" in out["reasons"][2]
    assert out["reasons"][3] == out["reasons"][2]
    # asked again, it was not run again (until the cache's tmpfs goes, at a reboot); the
    # cache made before for pos's CRIU stays
    assert calls.read_text().split() == ["check", "dump"]
    assert out["mounts"].count("/run/criu.kdat") == 1


def test_where_run_is_a_tmpfs_criu_keeps_its_own(criu_ready, folder: Path) -> None:
    out = child(folder, run_kind="tmpfs")
    assert out["states"] == ["criu-keeps", "criu-keeps"]
    assert str(kdat.ROOT) not in out["mounts"] and "/run/criu.kdat" not in out["mounts"]
    assert out["rc"] == 0


def test_a_user_other_than_root_is_left_to_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert kdat.keep("/nonexistent/criu", "4.2").state is kdat.State.UNPRIVILEGED
