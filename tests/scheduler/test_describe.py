"""The lines that checkpoint and restore print: each timing in its unit, and why a job waited."""

from pos.agent.control import Gate, Wait
from pos.scheduler.commands import _longest_wait
from pos.scheduler.engine import describe


def test_timings_memory_and_driver_answers_each_read_in_their_unit() -> None:
    line = describe({"lock": 0.0123, "criu_written_mib": 959.2, "stack_was_bytes": 1024,
                     "stack_rc": 0})
    assert line == "lock 0.012 s, criu_written_mib 959 MiB, stack_was_bytes 1024 bytes, stack_rc 0"


def test_the_report_names_the_longest_wait_and_what_it_waited_for() -> None:
    gate = Gate(3, 1.2, 0.9, 40, 0.1, 1, [
        Wait(0x7000_0000_0003, 0.2, 0.3, "_Z4axpyfPKfPfi"),
        Wait(None, 0.9, 1.0, "cuMemcpy2D_v2"),
        Wait(0x7000_0020_0000, 0.1, 1.1, "_Z" + "x" * 80)])
    assert _longest_wait(gate) == "; the longest, cuMemcpy2D_v2, waited for every buffer"
    gate = Gate(1, 0.2, 0.2, 40, 0.1, 0, [Wait(0x7000_0000_0003, 0.2, 0.3, "_Z" + "x" * 80)])
    assert _longest_wait(gate) == ("; the longest, _Z" + "x" * 55 + "..., waited for "
                                   "0x700000000003")
    assert _longest_wait(Gate(0, 0.0, 0.0, 40, None)) == ""
