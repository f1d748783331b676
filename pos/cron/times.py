"""When schedules fire, and what happens to fire times that pass unserved, over a clock that
tests control.

Library: croniter (maintained by pallets-eco, releases through 2025). It follows crontab(5)
exactly: 0 and 7 are Sunday, a day of month and a day of week both given mean either, and an
optional sixth field gives seconds. APScheduler 3's CronTrigger numbers weekdays from Monday
(`0 3 * * 0` fires on Mondays; fixed only in its 4.0 pre-releases), and pos needs the trigger
alone, not a scheduler: the daemon keeps its state in the store.

Cron times are UTC, like the names of the image directories, whatever the host's time zone.

Misfire policy, coalesce: when fire times have passed unserved (the daemon was down, or the
schedule's previous snapshot still ran), one snapshot serves them all and the run records how
many it folded in; the next fire time is the first after that run ends.
"""

from datetime import datetime, timezone
from typing import Protocol

from croniter import croniter
from croniter.croniter import CroniterBadDateError, CroniterError

from pos.errors import BadInput

# counting missed fire times stops here: a fire every second over a long outage is just "many"
MAX_COUNTED = 10_000


class Clock(Protocol):
    def now(self) -> datetime:
        """The current time, timezone-aware UTC."""
        ...


class SystemClock:
    def now(self) -> datetime:
        return datetime.now(timezone.utc)


FIELDS = (5, 6)     # minute hour day month weekday [second]: what docs promise
FIX = ("give five fields (minute hour day month weekday, UTC), or six with seconds last, "
       "e.g. '*/15 * * * *'")


def validate(expr: str) -> str:
    """The expression, stripped; BadInput when it has other than five or six fields (croniter
    also takes a seventh, the year, and `@hourly`: pos promises neither), with croniter's reason
    when it is not a cron line, or when it names no time that occurs (`* * 31 2 *`)."""
    expr = " ".join(expr.split())
    n = len(expr.split())
    if n and n not in FIELDS:
        raise BadInput(f"invalid cron expression '{expr}' ({n} field{'s' * (n > 1)})", FIX)
    try:
        croniter(expr, datetime(2000, 1, 1, tzinfo=timezone.utc)).get_next(datetime)
    except CroniterBadDateError:
        raise BadInput(f"cron expression '{expr}' never fires (no such date)",
                       "give a day of month that the month has, e.g. '0 0 28 2 *'") from None
    except (CroniterError, ValueError, KeyError) as e:
        reason = str(e).replace(f"[{expr}] ", "").rstrip(".") or "not understood"
        reason = reason[0].lower() + reason[1:]
        raise BadInput(f"invalid cron expression '{expr}' ({reason})", FIX) from None
    return expr


def next_fire(expr: str, after: datetime) -> datetime:
    """The first fire time strictly after `after` (UTC)."""
    return croniter(expr, after.astimezone(timezone.utc)).get_next(datetime)


def fires_between(expr: str, start: datetime, end: datetime) -> int:
    """How many fire times lie in (start, end] (at most MAX_COUNTED)."""
    it = croniter(expr, start.astimezone(timezone.utc))
    n = 0
    while n < MAX_COUNTED and it.get_next(datetime) <= end:
        n += 1
    return n
