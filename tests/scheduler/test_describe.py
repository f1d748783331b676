"""The one line of timings that checkpoint and restore print: each value in its unit."""

from pos.scheduler.engine import describe


def test_timings_memory_and_driver_answers_each_read_in_their_unit() -> None:
    line = describe({"lock": 0.0123, "criu_written_mib": 959.2, "stack_was_bytes": 1024,
                     "stack_rc": 0})
    assert line == "lock 0.012 s, criu_written_mib 959 MiB, stack_was_bytes 1024 bytes, stack_rc 0"
