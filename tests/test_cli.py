"""`pos`: every command's and subcommand's --help ends with examples (an epilog); errors in one
sentence; `pos doctor`'s line on CRIU's pre-dump."""

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from pos.cli import cli
from tests.engines.conftest import criu_ready, kernel_keeps_soft_dirty  # noqa: F401 (a fixture)


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    found = [path]
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            found += _commands(cmd, path + (name,))
        else:
            found.append(path + (name,))
    return found


def test_every_help_ends_with_examples() -> None:
    paths = _commands(cli)
    assert ("schedule", "add") in paths and ("doctor",) in paths
    for path in paths:
        r = CliRunner().invoke(cli, [*path, "--help"])
        assert r.exit_code == 0, (path, r.output)
        assert "\n  Examples:\n    pos " in r.output, f"pos {' '.join(path)} --help has no examples"


# ---- errors: one sentence with the cause and the fix, exit 2; with --json, a JSON object ----

def _one_sentence(args: list[str], *fragments: str) -> str:
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2, (args, r.exit_code, r.output)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and lines[0].endswith("."), r.output
    assert "Usage:" not in r.output and "Try '" not in r.output
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("args,fragments", [
    (["trace", "--bogus", "1"], ["pos trace has no option --bogus", "see `pos trace --help`"]),
    (["trace", "--dur", "3", "1"], ["did you mean --duration"]),
    (["--bogus"], ["pos has no option --bogus"]),
    (["frob"], ["pos has no command 'frob'", "see `pos --help` for its commands"]),
    (["trace", "1", "2"], ["pos trace got an unexpected extra argument (2): remove it"]),
    (["images", "ls", "extra"], ["pos images ls got an unexpected extra argument (extra)"]),
    (["checkpoint"], ["pos checkpoint needs the argument 'PID': give it"]),
    (["trace"], ["pos trace needs the argument PID (the process to trace): give it"]),
    (["schedule", "add"], ["pos schedule add needs the option '--cron': give it"]),
    (["trace", "1", "--db"], ["the option --db of pos trace needs a value: give one"]),
    (["trace", "1", "--duration", "-1"], ["is not in the range x>0: give a value in that range"]),
    (["export", "x.db", "--format", "csv"], ["is not one of", "give one of those"]),
    (["trace", "x"], ["is not a valid integer: give a whole number"]),
    (["export", "/tmp", "-o", "x"], ["directory", "give"]),
    (["migrate", "1", "--to-gpu", "x"], ["invalid value for '--to-gpu'", "give a GPU index"]),
])
def test_click_errors_are_one_sentence_with_a_fix(args: list[str], fragments: list[str]) -> None:
    line = _one_sentence(args, *fragments)
    assert line.count("--help`") <= 1     # one fix, not pos's and a generic one


def test_a_failure_with_json_is_a_json_object_on_stdout(tmp_path) -> None:
    """Bad input, click's or pos's own, and a failed operation alike."""
    import json

    for args, code in ((["images", "ls", "--json", "--bogus"], 2),
                       (["inspect", str(tmp_path / "none"), "--json"], 2),
                       (["export", str(tmp_path / "none.db"), "--json"], 2),
                       (["images", "prune", "--schedule", "7", "--json", "--db",
                         str(tmp_path / "none.db")], 2)):
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == code, (args, r.output)
        assert r.stderr == "", (args, r.stderr)
        said = json.loads(r.stdout)
        assert set(said) == {"error", "exit"} and said["exit"] == code, said
        assert said["error"].endswith(".") and ": " in said["error"], said
    # `--json` after `--` belongs to the job, not to pos
    r = CliRunner().invoke(cli, ["trace", "--bogus", "--", "--json"])
    assert r.stdout == "" and r.stderr.startswith("Error: ")


def test_every_listing_command_takes_json() -> None:
    """The commands that list things: each takes --json (pos analyze and inspect had it)."""
    listing = [("doctor",), ("images",), ("images", "ls"), ("images", "prune"),
               ("schedule", "ls"), ("inspect",), ("analyze",)]
    for path in listing:
        r = CliRunner().invoke(cli, [*path, "--help"])
        assert "--json" in r.output, path


def test_doctor_says_whether_criu_can_copy_memory_before_the_freeze(criu_ready) -> None:
    """The line of the kernel's soft-dirty tracking, as CRIU answers (as root) and the kernel
    says."""
    r = CliRunner().invoke(cli, ["doctor"])
    (line,) = [ln for ln in r.output.splitlines() if "soft-dirty tracking" in ln]
    label = "soft-dirty tracking (CRIU's pre-dump, of jobs that map no device)"
    if kernel_keeps_soft_dirty():
        assert line == f"ok       {label}"
    else:
        assert line == (
            f"n/a      {label}: this kernel does not track dirty pages (soft-dirty), so CRIU "
            "cannot copy a job's host memory before the freeze, and a whole-process concurrent "
            "checkpoint dumps all of it while the job is frozen: run a kernel built with "
            "CONFIG_MEM_SOFT_DIRTY=y.")


def test_doctor_and_the_migration_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a key, migration between hosts is off and the doctor says how to make one; a key
    that others can read is refused, by the doctor and by `pos migrate` alike; a second
    --new-key never replaces the first."""
    key = tmp_path / "key"
    monkeypatch.setenv("POS_MIGRATE_KEY", str(key))

    def line() -> str:
        r = CliRunner().invoke(cli, ["doctor"])
        (found,) = [ln for ln in r.output.splitlines() if "the migration key" in ln]
        return found

    assert line().startswith(f"n/a      the migration key (hosts authenticate each other over "
                             f"TLS): no migration key in {key}: ")
    r = CliRunner().invoke(cli, ["migrate", "--listen", "-D", str(tmp_path / "in")])
    assert r.exit_code == 2 and r.stderr.startswith(f"Error: there is no migration key in {key}")
    assert not (tmp_path / "in").exists()
    r = CliRunner().invoke(cli, ["migrate", "--new-key"])
    assert r.exit_code == 0, r.output
    assert line() == "ok       the migration key (hosts authenticate each other over TLS)"
    before = (key / "key.pem").read_bytes()
    r = CliRunner().invoke(cli, ["migrate", "--new-key"])
    assert (r.exit_code, r.stderr) == (2, f"Error: {key} already holds a migration key: copy "
                                          "that one to the other host, or give another folder "
                                          "with --key.\n")
    assert (key / "key.pem").read_bytes() == before
    (key / "key.pem").chmod(0o644)
    assert "can be read by others than its owner (mode -rw-r--r--" in line()
    r = CliRunner().invoke(cli, ["migrate", "--listen", "-D", str(tmp_path / "in")])
    assert r.exit_code == 2 and "chmod 600" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not (tmp_path / "in").exists()


def test_a_command_imports_no_numpy() -> None:
    """numpy's import took 0.3 s of a command's start on the H200 host: the commands and a
    concurrent checkpoint's modules leave it to a thread of the checkpoint's, beside the pin
    (tests/concurrent/test_export.py)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    code = ("import sys, pos.cli, pos.concurrent.checkpoint, pos.concurrent.copier, "
            "pos.concurrent.saver; print('numpy' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


@pytest.mark.parametrize("nvml_up, persistent, says", [
    (True, True, ""),
    (True, False, ": a GPU of this host is not in persistence mode, so a restore starts CUDA on "
                  "every GPU of the host (0.91-1.04 s on four H200s, against 0.19-0.33 s for "
                  "one): enable it: run nvidia-persistenced, or `nvidia-smi -pm 1`."),
    (False, False, ": NVML cannot be asked (no NVIDIA driver, or no libnvidia-ml.so.1): install "
                   "the NVIDIA driver if this host runs CUDA jobs.")],
    ids=["on", "off", "no nvml"])
def test_doctor_says_whether_the_gpus_stay_started(monkeypatch: pytest.MonkeyPatch, nvml_up,
                                                   persistent, says) -> None:
    from pos import nvml

    monkeypatch.setattr(nvml, "available", lambda: nvml_up)
    monkeypatch.setattr(nvml, "persistent", lambda: persistent)
    r = CliRunner().invoke(cli, ["doctor"])
    (line,) = [ln for ln in r.output.splitlines() if "persistence mode" in ln]
    label = "GPUs in persistence mode (a restore starts CUDA on its own GPUs alone)"
    assert line == ("ok       " if persistent else "n/a      ") + label + says
