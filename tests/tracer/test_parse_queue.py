"""The order in which the tracer's parse workers take module shares (pos/tracer/session.py)."""

from pos.tracer.session import _Module, next_share


def test_a_worker_takes_first_the_share_of_a_module_whose_kernel_was_looked_up() -> None:
    """Shares wait in the tracer's queue; a free worker takes the oldest, unless a looked-up
    kernel waits for a module's layouts: then that module's shares go first."""
    a, b = (_Module({"handle": h}, addr=0, size=1 << 30, shares=2) for h in (1, 2))
    queue = [(a, 0), (a, 1), (b, 0), (b, 1)]
    assert next_share(queue) == 0
    b.wanted = True
    assert next_share(queue) == 2
    assert next_share(queue[3:]) == 0
