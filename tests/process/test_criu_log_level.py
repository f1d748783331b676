"""What CRIU logs: a dump's CRIU its errors and warnings unless POS_CRIU_DUMP_LOG_LEVEL says
otherwise (it writes its log while the job is frozen), a restore's CRIU every step (its log's
bound ends a restorer that loops)."""

from pathlib import Path

import pytest

from pos.errors import BadInput
from pos.process import criu
from pos.process.criu import Options, PageServer
from pos.settings import Settings


def level_of(argv: list[str]) -> str:
    return next(a for a in argv if a.startswith("-v"))


@pytest.mark.parametrize("raw, level", [(None, "-v2"), ("0", "-v0"), ("4", "-v4")])
def test_the_dump_s_level_is_the_setting_and_the_restore_s_is_full(raw: str, level: str,
                                                                    monkeypatch) -> None:
    monkeypatch.setattr(criu, "_find", lambda *_: criu.Criu("/usr/sbin/criu", (4, 2)))
    s = Settings.from_env({} if raw is None else {"POS_CRIU_DUMP_LOG_LEVEL": raw})
    c = criu.find(s)
    opts, img, work = Options(), Path("/img"), Path("/work")
    assert level_of(c.dump_argv(7, img, opts, True)) == level
    assert level_of(c.predump_argv(7, img, opts)) == level
    assert level_of(c.page_server_argv(img, PageServer("127.0.0.1", 1), work)) == level
    assert level_of(c.restore_argv(img, opts, work, work / "pid")) == "-v4"
    assert level_of(c.lazy_pages_argv(img, work, 3)) == "-v4"


@pytest.mark.parametrize("raw", ["5", "-1", "debug"])
def test_a_bad_level_is_one_sentence(raw: str) -> None:
    with pytest.raises(BadInput, match=f"POS_CRIU_DUMP_LOG_LEVEL={raw} is not a CRIU log level "
                                       "from 0 to 4") as e:
        Settings.from_env({"POS_CRIU_DUMP_LOG_LEVEL": raw})
    assert "unset it" in e.value.fix
