"""CRIU's log level for dumps: low by default (its every line is written while the job is
frozen), raised by POS_CRIU_DUMP_VERBOSITY, and a bad value refused before anything runs."""

from pathlib import Path

import pytest

from pos.errors import BadInput
from pos.scheduler import criu
from pos.scheduler.criu import Criu, Options


def argv(monkeypatch: pytest.MonkeyPatch, value: str | None) -> list[str]:
    if value is None:
        monkeypatch.delenv(criu.DUMP_VERBOSITY_ENV, raising=False)
    else:
        monkeypatch.setenv(criu.DUMP_VERBOSITY_ENV, value)
    return Criu("/usr/bin/criu", (4, 2)).dump_argv(1, Path("/tmp/img"), Options(), True)


def test_dumps_log_errors_and_warnings_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "-v2" in argv(monkeypatch, None)
    assert "-v4" in argv(monkeypatch, "4")


def test_restores_keep_every_step() -> None:
    r = Criu("/usr/bin/criu", (4, 2)).restore_argv(Path("/tmp/img"), Options(), Path("/tmp/w"),
                                                    Path("/tmp/w/pid"))
    assert "-v4" in r


@pytest.mark.parametrize("bad", ["5", "-1", "debug", ""])
def test_a_bad_level_is_one_sentence_before_criu_is_looked_for(
        monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv(criu.DUMP_VERBOSITY_ENV, bad)
    with pytest.raises(BadInput) as e:
        criu.find()
    assert criu.DUMP_VERBOSITY_ENV in str(e.value)
