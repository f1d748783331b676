"""What each number of an operation's `timings` is, told from its key. The manifest and `--json`
keep one flat dict of numbers per operation (seconds of its steps, and beside them sizes, the
driver's return codes, counts and moments); this module is the one place that reads a key's
kind from its name, for the summary, `pos inspect` and the sum over a job's processes.

The rule: a key ending in `_mib` or `_bytes` is a size, `_rc` a return code, `_n` a count,
`_at` a moment (seconds from the operation's start); any other key is the seconds one step
took, but for the few keys named in EXCEPTIONS."""

import enum


class Kind(enum.Enum):
    """What one timing is: only a step's seconds is where an operation's time went."""

    STEP = "step"            # the seconds one step took
    THREADS = "threads"      # seconds summed over threads that ran side by side
    MOMENT = "moment"        # seconds from the operation's start
    MIB = "mib"              # a size in MiB
    BYTES = "bytes"          # a size in bytes
    CODE = "code"            # what the driver (or the agent) answered
    COUNT = "count"          # how many


SUFFIXES = {"_mib": Kind.MIB, "_bytes": Kind.BYTES, "_rc": Kind.CODE, "_n": Kind.COUNT,
            "_at": Kind.MOMENT}
# the keys whose name does not say what they are
EXCEPTIONS = {"read_threads": Kind.THREADS, "sealed_s": Kind.MOMENT}
# how a value reads for a person: seconds, but for these kinds
UNITS = {Kind.MIB: "{:.0f} MiB", Kind.BYTES: "{:.0f} bytes", Kind.CODE: "{:.0f}",
         Kind.COUNT: "{:.0f}"}


def kind(key: str) -> Kind:
    """What the value of `key` is."""
    if key in EXCEPTIONS:
        return EXCEPTIONS[key]
    return next((k for end, k in SUFFIXES.items() if key.endswith(end)), Kind.STEP)


def split(timings: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """The steps' seconds, and apart from them everything else (sizes, codes, counts, moments,
    sums over threads), each in the order of `timings`."""
    steps = {k: v for k, v in timings.items() if kind(k) is Kind.STEP}
    return steps, {k: v for k, v in timings.items() if k not in steps}


def describe(timings: dict[str, float]) -> str:
    """Timings for a person, each in its unit."""
    return ", ".join(f"{k} {UNITS.get(kind(k), '{:.3f} s').format(v)}"
                     for k, v in timings.items())
