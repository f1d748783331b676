"""pos's side of the agent's protocol (pos/agent/control.py), without a job."""

from typing import Any

from pos.agent.control import Agent, Buffer


def _agent(reply: dict[str, Any]) -> Agent:
    a = Agent.__new__(Agent)            # no connection: `_ask` answers with `reply`
    a._ask = lambda _line: reply        # type: ignore[method-assign]
    return a


def test_the_table_says_which_buffers_calls_used() -> None:
    a = _agent({"ok": True, "version": 2, "buffers": [
        {"va": 4096, "size": 10, "mapped": 4096, "device": 0, "present": True, "touched": True},
        {"va": 8192, "size": 20, "mapped": 4096, "device": 1, "present": False,
         "touched": False, "later": 7}]})
    assert a.table() == [Buffer(4096, 10, 4096, 0, True, True),
                         Buffer(8192, 20, 4096, 1, False, False)]


def test_an_agent_from_before_named_fields_is_read_by_position() -> None:
    """Version 1 (no `version`): a buffer is [va, size, mapped, device, present, touched]."""
    a = _agent({"ok": True, "buffers": [[4096, 10, 4096, 0, 1, 1], [8192, 20, 4096, 1, 0, 0]]})
    assert a.table() == [Buffer(4096, 10, 4096, 0, True, True),
                         Buffer(8192, 20, 4096, 1, False, False)]


def test_an_agent_from_before_the_mark_is_read_as_marking_nothing() -> None:
    """A job started under an older pos keeps its agent, which sends five fields a buffer."""
    a = _agent({"ok": True, "buffers": [[4096, 10, 4096, 0, 1]]})
    assert a.table() == [Buffer(4096, 10, 4096, 0, True, False)]


STATUS = {"ok": True, "pid": 7, "phase": "idle", "buffers": 1, "owned_bytes": 4096,
          "foreign_allocs": 0, "foreign_bytes": 0, "owning": True, "imported": 0,
          "nccl_launches": 0, "held": 0, "held_s": 0.0, "held_max_s": 0.0, "passed": 0,
          "first_pass_s": -1.0}


def test_the_status_says_what_the_job_maps_of_other_processes() -> None:
    st = _agent({**STATUS, "peer_maps": 2, "peer_bytes": 8192, "ipc_maps": 1, "own_maps": 3,
                 "own_bytes": 6 << 20}).status()
    assert (st.peer_maps, st.peer_bytes, st.ipc_maps) == (2, 8192, 1)
    assert (st.own_maps, st.own_bytes) == (3, 6 << 20)


def test_an_agent_from_before_peer_memory_is_read_as_not_saying() -> None:
    """Not as "no peer memory": pos cannot tell, and must not assume there is none."""
    st = _agent(STATUS).status()
    assert (st.peer_maps, st.peer_bytes, st.ipc_maps) == (None, None, None)
    assert (st.own_maps, st.own_bytes) == (None, None)


def test_how_a_connection_ended_is_acted_on_by_its_code(monkeypatch) -> None:
    """The fix pos gives for a connection the agent ended comes from the agent's code, not from
    the words of its sentence (which may change, and are for a person)."""
    import time

    from pos.agent import control

    def gone(code: str, words: str) -> str:
        a = Agent.__new__(Agent)
        a.pid, a._request, a._probe, a._answered = 4242, "cut", False, time.monotonic()
        status = a_status(last_end=words, last_end_code=code, stall_s=3.0)
        monkeypatch.setattr(control, "_running", lambda _pid: True)
        monkeypatch.setattr(control, "_ask_again", lambda _pid: status)
        return a._gone("EOF").fix

    words = "in phase hold, 3.0 s after pos's last request: unrelated words"
    assert "larger POS_AGENT_STALL_S" in gone("silent", words)
    assert gone("eof", words).startswith("pos had not closed its end")
    assert gone("reused", words).startswith("other code of the job closed")
    assert gone("failed", "pos sent nothing, EOF, reused") == "retry; the job runs on as it was"


def a_status(**fields: Any) -> "Status":
    from pos.agent.control import Gate, Status

    gate = Gate.from_reply({"held": 0, "held_s": 0.0, "held_max_s": 0.0, "passed": 0})
    return Status(4242, "idle", 0, 0, 0, 0, True, 0, gate, **fields)
