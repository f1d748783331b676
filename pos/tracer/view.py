"""The live terminal view of `pos trace` (rich), and its one-line plain form."""

import time
from typing import Optional

from rich.console import Group
from rich.table import Table
from rich.text import Text

from pos.tracer.late import OUTSIDE, REASONS
from pos.tracer.session import Stats


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


class LiveView:
    """Renders Stats; keeps the previous sample to show rates."""

    def __init__(self, pid: int, comm: str) -> None:
        self.pid, self.comm = pid, comm
        self.started = self._last_t = time.monotonic()
        self._last_launches = 0
        self.rate = 0.0

    def sample(self, stats: Stats) -> None:
        now = time.monotonic()
        launches = stats.events["launches"]
        if now - self._last_t >= 0.5:
            self.rate = (launches - self._last_launches) / (now - self._last_t)
            self._last_t, self._last_launches = now, launches

    def render(self, stats: Stats, top: int = 8) -> Group:
        e = stats.events
        head = Text.assemble(
            (f"pos trace {self.pid} ({self.comm})", "bold"),
            f"  {time.monotonic() - self.started:6.1f} s   ",
            f"launches {e['launches']:,} ({self.rate:,.0f}/s)   allocs {e['allocations']:,}   "
            f"copies {e['copies']:,}   live {human_bytes(stats.live_bytes)}   "
            f"copied {human_bytes(stats.copied_bytes)}   ",
            (f"lost {stats.lost:,}", "bold red" if stats.lost else ""))
        table = Table(box=None, pad_edge=False, expand=False)
        table.add_column("LAUNCHES", justify="right")
        table.add_column("KERNEL", overflow="ellipsis", no_wrap=True, max_width=64)
        for name, n in stats.kernels.most_common(top):
            table.add_row(f"{n:,}", name)
        return Group(head, table)

    def summary(self, stats: Stats, seconds: float, db: str, status: Optional[str] = None) -> str:
        """The last line: `seconds` is how long the probes were attached."""
        e = stats.events
        known = f"{100 * stats.layout_known / e['launches']:.1f}%" if e["launches"] else "n/a"
        known += " with layout"
        done = stats.completion
        if done.completed:
            known += f", {done.completed:,} completed when their layout came"
        if stats.captures_dropped:
            known += f"; {stats.captures_dropped:,} lost their capture to the credit"
        if missing := done.reasons():
            known += "; without: " + ", ".join(
                f"{n:,} {REASONS[r]}" + (f" (by up to {done.missing_outside_bytes:,} B)"
                                             if r == OUTSIDE else "")
                for r, n in missing.items())
        return (f"traced {self.pid} for {seconds:.1f} s"
                f"{' (' + status + ')' if status else ''}: {e['launches']:,} launches "
                f"({known}), {e['allocations']:,} allocation events, "
                f"{e['copies']:,} copies/sets, {e['syncs']:,} syncs, {e['functions']:,} "
                f"functions, {stats.lost:,} lost"
                f"{'; layout maps ran full' if stats.layouts_full else ''} -> {db}")
