"""`pos trace` on bad input: one sentence naming the cause and the fix, exit 2, no traceback."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from pos import host
from pos.cli import cli
from tests.conftest import ROOT, need


def _pos(*args: str, env: dict[str, str] | None = None,
         prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "pos.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=60)


def _one_sentence(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def test_no_such_pid() -> None:
    pid = 4_000_000     # above pid_max's ceiling: never a process
    r = CliRunner().invoke(cli, ["trace", str(pid), "--db", "/tmp/unused.db"])
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: no process has PID {pid}: give the PID of a running "
                                "process.")


def test_process_without_gpu_library(sleeper: subprocess.Popen) -> None:
    _one_sentence(_pos("trace", str(sleeper.pid)), "maps no GPU driver library",
                  "has initialised CUDA or HIP")


def test_caller_without_privileges(tmp_path: Path) -> None:
    need(os.geteuid() == 0 and shutil.which("setpriv") is not None,
         "dropping privileges needs root and setpriv")
    drop = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all")
    p = subprocess.Popen([*drop, "sleep", "60"])
    try:
        r = _pos("trace", str(p.pid), "--lib", "/bin/true", "--db", str(tmp_path / "t.db"),
                 prefix=drop)
    finally:
        p.kill()
        p.wait()
    _one_sentence(r, "pos needs root or CAP_SYS_ADMIN, CAP_BPF, CAP_PERFMON", "sudo")


def test_memory_map_of_another_users_process(tmp_path: Path) -> None:
    need(os.geteuid() == 0 and shutil.which("setpriv") is not None,
         "dropping privileges needs root and setpriv")
    p = subprocess.Popen(["sleep", "60"])      # root's, traced by nobody
    try:
        r = _pos("trace", str(p.pid), "--db", str(tmp_path / "t.db"),
                 prefix=("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                         "--inh-caps=-all"))
    finally:
        p.kill()
        p.wait()
    _one_sentence(r, f"cannot read the memory map of PID {p.pid} as this user: run pos as root")


def test_memory_map_denied_to_root(monkeypatch: pytest.MonkeyPatch,
                                   sleeper: subprocess.Popen) -> None:
    """Some hosts deny root the maps of a protected process (PID 1 of a Firecracker VM): pos
    says that, not "run pos as root"."""
    need(os.geteuid() == 0, "the case of root")
    read_text = Path.read_text

    def denied(self: Path, *args, **kwargs) -> str:
        if self.name == "maps":
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    r = CliRunner().invoke(cli, ["trace", str(sleeper.pid), "--db", "/tmp/unused.db"])
    assert r.exit_code == 2
    assert r.output.strip() == (
        f"Error: this host denies even root the memory map of PID {sleeper.pid} "
        f"(/proc/{sleeper.pid}/maps), so its driver library cannot be found: trace another "
        "process (this one is protected here).")


def test_missing_bcc(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    fake = tmp_path / "bcc"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('no bcc here')\n")
    r = _pos("trace", str(sleeper.pid), "--lib", "/bin/true", "--db", str(tmp_path / "t.db"),
             env={"PYTHONPATH": f"{tmp_path}:{ROOT}"})
    _one_sentence(r, "bcc's Python package is not importable", "apt-get install python3-bpfcc")


def test_missing_kernel_headers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host.platform, "release", lambda: "0.0.0-none")
    problem = host.check_kernel_headers()
    if Path("/sys/kernel/kheaders.tar.xz").exists():
        assert problem is None      # the kernel carries its own headers
    else:
        assert problem is not None and problem.message == (
            "no kernel headers for kernel 0.0.0-none (bcc compiles its probes with them): install "
            "linux-headers-0.0.0-none or run scripts/setup.sh from the pos checkout (it installs "
            "bcc and the headers).")


def test_trace_without_pid_is_a_usage_error() -> None:
    r = CliRunner().invoke(cli, ["trace"])
    assert r.exit_code == 2 and r.output == (
        "Error: pos trace needs the argument PID (the process to trace): give it, as the "
        "examples of `pos trace --help` do.\n")


def test_lib_that_is_not_elf(tmp_path: Path, sleeper: subprocess.Popen) -> None:
    """A --lib that is not a library is bad input (exit 2), said before anything is set up."""
    text = tmp_path / "notes.txt"
    text.write_text("not a library\n")
    r = CliRunner().invoke(cli, ["trace", str(sleeper.pid), "--lib", str(text), "--db",
                                 str(tmp_path / "t.db")])
    assert r.exit_code == 2
    assert r.output.strip() == (f"Error: {text} is not an ELF file, so not a driver library: "
                                "give --lib the GPU driver library (libcuda.so.1 or "
                                "libamdhip64.so).")
    assert not (tmp_path / "t.db").exists()


def test_ebpf_prints_both_programs() -> None:
    r = CliRunner().invoke(cli, ["trace", "--ebpf"])
    assert r.exit_code == 0
    assert "LAUNCH(cuLaunchKernel)" in r.output and "int on_hipModuleLaunchKernel(" in r.output
    code = re.sub(r"/\*.*?\*/|//[^\n]*", "", r.output, flags=re.S)
    assert "RINGBUF_PAGES" not in code and "API_DEFINES" not in code
    assert "BPF_RINGBUF_OUTPUT(events, 16384);" in code


def test_ebpf_leaves_the_comments_as_written() -> None:
    """The placeholders are filled in code only: common.h's opening comment, which names them,
    reaches the printed program unchanged."""
    common = (Path(ROOT) / "pos" / "bpf" / "common.h").read_text()
    first_comment = common[:common.index("*/") + 2]
    assert "RINGBUF_PAGES" in first_comment
    out = CliRunner().invoke(cli, ["trace", "--ebpf"]).output
    assert first_comment in out


def test_ebpf_is_kept_out_of_the_help() -> None:
    """As bcc's tools do: --ebpf works, and --help does not show it."""
    r = CliRunner().invoke(cli, ["trace", "--help"])
    assert r.exit_code == 0 and "--ebpf" not in r.output
