"""The setup scripts' own logic: scripts/criu-debs.sh takes the Debian mirror from the host's
apt sources (one-line and deb822), never from a host name written in the script."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

CRIU_DEBS = ROOT / "scripts" / "criu-debs.sh"


def codename() -> str:
    fields = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', Path("/etc/os-release").read_text(), re.M))
    if fields.get("ID") != "debian":
        pytest.skip("the mirror is taken from a Debian host's sources")
    return fields["VERSION_CODENAME"]


def mirror(etc: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CRIU_DEBS), "--mirror"], capture_output=True, text=True,
                          env={**os.environ, "APT_ETC": str(etc), **env})


def test_mirror_from_one_line_sources(tmp_path: Path) -> None:
    c = codename()
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(
        f"# deb http://commented.example/debian {c} main\n"
        f"deb-src http://src.example/debian {c} main\n"
        f"deb [signed-by=/k.gpg] http://sec.example/debian-security {c}-security main\n"
        f"deb [arch=amd64] http://mirror.example/debian/ {c} main contrib\n")
    r = mirror(tmp_path)
    assert (r.returncode, r.stdout) == (0, "http://mirror.example/debian\n"), r.stderr


def test_mirror_from_deb822_sources(tmp_path: Path) -> None:
    c = codename()
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        f"Types: deb\nURIs: http://disabled.example/debian\nSuites: {c}\nEnabled: no\n\n"
        f"Types: deb\nURIs: http://sec.example/debian-security\nSuites: {c}-security\n\n"
        f"Types: deb deb-src\n# a comment\nURIs: https://mirror.example/debian\n"
        f"Suites: {c}-updates\n {c}\nComponents: main\n")
    (tmp_path / "sources.list.d" / "other.list").write_text(
        "deb https://vendor.example/apt nodistro main\n")
    r = mirror(tmp_path)
    assert (r.returncode, r.stdout) == (0, "https://mirror.example/debian\n"), r.stderr


def test_no_debian_mirror_is_one_sentence_and_the_variable_overrides(tmp_path: Path) -> None:
    (tmp_path / "sources.list").write_text("deb https://vendor.example/apt nodistro main\n")
    r = mirror(tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "set POS_DEBIAN_MIRROR" in r.stderr, r.stderr
    r = mirror(tmp_path, POS_DEBIAN_MIRROR="http://given.example/debian")
    assert (r.returncode, r.stdout) == (0, "http://given.example/debian\n"), r.stderr


def test_gpu_tests_say_what_they_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no GPU is, the GPU suite is skipped with the reason a user can act on."""
    from tests.gpu import conftest as gpu

    class Item:
        fspath = ROOT / "tests" / "gpu" / "test_x.py"

        def __init__(self) -> None:
            self.markers: list = []

        def add_marker(self, marker) -> None:
            self.markers.append(marker)

    monkeypatch.setattr(gpu, "_has_gpu", lambda: False)
    item = Item()
    gpu.pytest_collection_modifyitems([item])  # type: ignore[list-item]
    reasons = [m.kwargs["reason"] for m in item.markers if m.name == "skip"]
    assert reasons == ["needs an NVIDIA GPU with PyTorch"]


@pytest.mark.bpf
def test_the_demo_says_where_its_output_is_and_keeps_only_that(tmp_path: Path,
                                                                bpf_ready: None) -> None:
    """scripts/demo.sh (fake driver, real eBPF and CRIU): exit 0; its last line names the
    folder and what it kept there, and nothing else of it is left; the fake driver's state went
    into that folder, not /tmp/pos-fakecuda."""
    import shutil

    from tests.conftest import need

    need(shutil.which("nvcc") is not None, "nvcc is needed to build the fake driver")
    need(Path("/opt/pos/criu/criu").exists() or shutil.which("criu") is not None,
         "CRIU is needed for the demo's checkpoint")
    out = tmp_path / "demo"
    default_state = Path("/tmp/pos-fakecuda")
    there_before = default_state.exists()
    env = {k: v for k, v in os.environ.items() if k != "POS_FAKECUDA_STATE_DIR"}
    r = subprocess.run([str(ROOT / "scripts" / "demo.sh")], cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**env, "POS_DEMO_DIR": str(out)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"demo: its files go to {out}" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith(f"demo: kept in {out}: demo.db, trace.jsonl, trace.perfetto.json")
    assert last.endswith(f"rm -r {out}")
    assert sorted(p.name for p in out.iterdir()) == ["demo.db", "trace.jsonl",
                                                      "trace.perfetto.json"]
    assert default_state.exists() == there_before
