"""The lines that checkpoint, restore and inspect print: each timing in its unit (and told from
its key by one rule), why a job waited, and the short summaries (the stall, the size, where the
time went) in place of every field."""


from click.testing import CliRunner

from pos.agent.control import Gate, Wait
from pos.cli import cli
from pos.engines import summary
from pos.engines.summary import longest_wait
from pos.image import Manifest, write_manifest
from pos.operation.engine import DeviceCopy, Operation, Report, WaitedFor
from pos.operation.timings import Kind, describe, kind, split


def test_timings_memory_and_driver_answers_each_read_in_their_unit() -> None:
    line = describe({"lock": 0.0123, "criu_written_mib": 959.2, "stack_was_bytes": 1024,
                     "stack_rc": 0})
    assert line == "lock 0.012 s, criu_written_mib 959 MiB, stack_was_bytes 1024 bytes, stack_rc 0"


def test_the_report_names_the_longest_wait_and_what_it_waited_for() -> None:
    gate = Gate(3, 1.2, 0.9, 40, 0.1, 1, [
        Wait(0x7000_0000_0003, 0.2, 0.3, "_Z4axpyfPKfPfi"),
        Wait(None, 0.9, 1.0, "cuMemcpy2D_v2"),
        Wait(0x7000_0020_0000, 0.1, 1.1, "_Z" + "x" * 80)])
    assert longest_wait(gate) == "; the longest, cuMemcpy2D_v2, waited for every buffer"
    gate = Gate(1, 0.2, 0.2, 40, 0.1, 0, [Wait(0x7000_0000_0003, 0.2, 0.3, "_Z" + "x" * 80)])
    assert longest_wait(gate) == ("; the longest, _Z" + "x" * 55 + "..., waited for "
                                  "0x700000000003")
    assert longest_wait(Gate(0, 0.0, 0.0, 40, None)) == ""


def test_the_report_says_what_the_buffer_waited_for_reaches() -> None:
    """A checkpoint's longest wait on a shadowed buffer: its size, and the buffers reachable
    through its words that the call waited for too, and when the job had it."""
    gate = Gate(2, 1.9, 1.78, 40, 0.1, 0, [Wait(0x7000_0000_0000, 1.78, 4.6, "sm80_xmma_gemm"),
                                          Wait(0x7100_0000_0000, 0.1, 1.7, "_Z4axpyfPKfPfi")])
    why = [WaitedFor(0x7100_0000_0000, 2**20, False, 0, 0, 1.7, 1.7, None),
           WaitedFor(0x7000_0000_0000, 786 * 2**20, True, 12, 9 * 2**30, 4.625, 1.2, 4.6)]
    assert longest_wait(gate, why) == (
        "; the longest, sm80_xmma_gemm, waited for 0x700000000000, 786.0 MiB, shadowed, whose "
        "words reach 12 buffers (9.00 GiB), its addresses known 1.200 s, what they reach saved "
        "4.600 s, the job's 4.625 s after the cut")
    assert longest_wait(gate, why[:1]) == "; the longest, sm80_xmma_gemm, waited for 0x700000000000"


def test_longest_steps_are_durations_only() -> None:
    # amounts, moments since the start and sums over threads are no step
    timings = {"lock": 0.02, "checkpoint": 0.5, "dump": 0.79, "frozen": 0.69,
               "criu_written_mib": 1223.0, "read_threads": 13.3, "filled_at": 2.25,
               "sealed_s": 9.0, "free_at_cut_bytes": 8e9}
    assert summary.longest_steps(timings) == ("longest steps: dump 0.790 s, frozen 0.690 s, "
                                              "checkpoint 0.500 s")


def test_each_timing_is_told_from_its_key_by_one_rule() -> None:
    assert [kind(k) for k in ("lock", "criu_written_mib", "free_at_cut_bytes", "stack_rc",
                              "leaked_closed_n", "all_back_at", "pos_started_s",
                              "read_threads", "sealed_s")] == [
        Kind.STEP, Kind.MIB, Kind.BYTES, Kind.CODE, Kind.COUNT, Kind.MOMENT, Kind.STEP,
        Kind.THREADS, Kind.MOMENT]
    assert split({"lock": 0.1, "stack_rc": 0, "dump": 0.7, "filled_at": 2.0}) == (
        {"lock": 0.1, "dump": 0.7}, {"stack_rc": 0, "filled_at": 2.0})


def test_inspect_prints_the_steps_apart_from_sizes_codes_and_moments(tmp_path) -> None:
    m = _manifest(stall_s=1.0)
    m.files = {}                  # what inspect reads is the manifest alone
    m.timings = {"lock": 0.012, "stack_rc": 0, "free_at_cut_bytes": 8 * 2**30, "dump": 1.8,
                 "criu_written_mib": 959.0}
    write_manifest(tmp_path, m)
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert "steps    dump 1.800 s, lock 0.012 s" in lines       # the manifest's keys sorted
    assert ("figures  criu_written_mib 959 MiB, free_at_cut_bytes 8589934592 bytes, stack_rc 0"
            in lines)


def _manifest(stall_s=None) -> Manifest:
    return Manifest(pid=4242, pids=[4242, 4243], gpu_pids=[4242], comm="python3",
                    cmdline="python3 train.py", created_at="2026-11-26T10:00:00+00:00",
                    host="h", kernel="6.18", criu_version="4.2", criu_options={},
                    leave_running=stall_s is not None, files={f"f{i}": {} for i in range(14)},
                    size_bytes=3 * 2**30 + 2**29, stall_s=stall_s,
                    timings={"lock": 0.012, "checkpoint": 9.02, "dump": 1.8, "restore": 3.2,
                             "unlock": 0.001, "checksum": 1.2, "criu_written_mib": 959.0})


def test_a_stop_the_world_checkpoint_in_four_lines() -> None:
    m = _manifest(stall_s=12.5)
    lines = summary.of(Report("stop-the-world", Operation.CHECKPOINT, "/img/job1", m,
                              timings=m.timings))
    assert lines == [
        "saved PID 4242 (python3) into /img/job1: 3.50 GiB in 14 files, 2 process(es), 1 with "
        "CUDA state",
        "the job stood still 12.500 s",
        "longest steps: checkpoint 9.020 s, restore 3.200 s, dump 1.800 s",
        "every field: pos inspect /img/job1 (or --json)"]
    m = _manifest()
    held = summary.of(Report("stop-the-world", Operation.CHECKPOINT, "/img/job1", m,
                             timings=m.timings))[1]
    assert held == "it was ended once saved (restore it with `pos restore -D DIR`)"


def test_a_stop_the_world_restore() -> None:
    m = _manifest()
    lines = summary.of(Report("stop-the-world", Operation.RESTORE, "/img/job1", m,
                              restored_pid=4242,
                              timings={"prepare": 0.1, "criu_restore": 2.25, "verify": 0.6,
                                       "restore": 0.8, "unlock": 0.002}))
    assert lines == ["restored PID 4242 from /img/job1: 3.50 GiB in 14 files",
                     "longest steps: criu_restore 2.250 s, restore 0.800 s, verify 0.600 s",
                     "every field: --json"]


def test_a_concurrent_checkpoint_and_restore() -> None:
    timings = {"pin": 6.364, "cut": 0.0001, "shadow": 0.012, "d2h": 0.318, "disk": 2.009,
               "lock": 0.023, "checkpoint": 0.498, "dump": 0.786, "frozen": 0.694,
               "criu_written_mib": 1223.0, "move": 0.779, "checksum": 1.801}
    r = Report("concurrent", Operation.CHECKPOINT, "/img/full", None, timings=timings,
               device=DeviceCopy(12, int(16.17 * 2**30), None, None, release_s=1.325,
                                 d2h_gbps=54.6))
    assert summary.of(r) == [
        "saved /img/full: 16.17 GiB of device memory in 12 buffers",
        "the job was held 1.325 s",
        "device memory copied at 54.6 GB/s (PCIe limit ~55)",
        "longest steps: pin 6.364 s, disk 2.009 s, checksum 1.801 s",
        "every field: pos inspect /img/full (or --json)"]
    gate = Gate(3, 0.9, 0.772, 40, 0.1, 0, [Wait(None, 0.772, 1.0, "cuMemcpy2D_v2")])
    r = Report("concurrent", Operation.RESTORE, "/img/full", None, restored_pid=706,
               timings={"criu_restore": 0.781, "verify": 0.382, "restore": 0.306, "h2d": 1.089,
                        "read_threads": 13.274, "all_back_at": 2.251},
               device=DeviceCopy(12, int(16.17 * 2**30), None, gate, release_s=1.453,
                                 h2d_gbps=15.9, foreign_bytes=3 * 2**20))
    assert summary.of(r) == [
        "restored PID 706 from /img/full: 16.17 GiB of device memory in 12 buffers",
        "the job ran again 1.453 s after the restore began; its longest held call waited "
        "0.772 s (3 held, 0.900 s in all; the longest, cuMemcpy2D_v2, waited for every buffer)",
        "device memory read back at 15.9 GB/s (PCIe limit ~55), all of it back 2.251 s after "
        "the restore began",
        "longest steps: h2d 1.089 s, criu_restore 0.781 s, verify 0.382 s",
        "3.0 MiB the agent could not own (stream-ordered pools, managed or pitched memory, the "
        "job's own VMM mappings) went through the driver's checkpoint, inside the frozen part",
        "every field: --json"]


def test_a_whole_process_checkpoint_says_how_criu_saved_the_host_memory() -> None:
    device = DeviceCopy(12, 2**30, None, None, release_s=1.1, d2h_gbps=50.0)
    m = _manifest(stall_s=1.1)
    m.predumped, m.predump_note = False, "turned off (POS_PREDUMP=0)"
    lines = summary.of(Report("concurrent", Operation.CHECKPOINT, "/img/full", m,
                              timings=m.timings, device=device))
    assert lines[4] == ("host memory: dumped while the job was frozen; no pre-dump: turned off "
                        "(POS_PREDUMP=0)")
    m.predumped, m.predump_note = True, ""
    lines = summary.of(Report("concurrent", Operation.CHECKPOINT, "/img/full", m,
                              timings=m.timings, device=device))
    assert lines[4] == ("host memory: CRIU's pre-dump copied it before the freeze, the frozen "
                        "dump only what the job wrote since")
    m.predumped = None          # an engine that never pre-dumps: no such line
    assert len(summary.of(Report("concurrent", Operation.CHECKPOINT, "/img/full", m,
                                 timings=m.timings, device=device))) == 5


def test_a_migration() -> None:
    assert summary.migration({"pid": 4242, "gpu": 1, "timings": {"lock": 0.01, "restore": 2.5}}) \
        == ["moved PID 4242 onto GPU 1", "longest steps: restore 2.500 s, lock 0.010 s",
            "every field: --json"]
    assert summary.migration({"pid": 4242, "host": "10.0.0.2:7070", "restored_pid": 4242,
                              "timings": {"checkpoint.dump": 0.8, "send": 3.1}})[0] == \
        "moved PID 4242 to 10.0.0.2:7070; it runs there as PID 4242"
