"""libposhook.so, the agent that `pos run` preloads into a job (the C files beside this one;
built by pos/native.py)."""

from pathlib import Path

from pos import native


def build(force: bool = False) -> Path:
    """The preload library, compiled if missing or older than its sources."""
    return native.build(native.HOOK, force)
