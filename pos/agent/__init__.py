"""The in-process agent of `pos run`: CUPTI callbacks compiled with numba (cut, soft copy-on-write,
allocation table), the copier, and a root-only control socket.

The socket path is the one contract with the scheduler side (pos/scheduler/concurrent.py):
`socket_path(pid)`.
"""

from pos.errors import PosError

SOCKET_DIR = "/run/pos"
SOCKET_TEMPLATE = SOCKET_DIR + "/agent-{pid}.sock"
ENABLE_ENV = "POS_AGENT"            # "1": the sitecustomize starts the agent
RUN_NAME_ENV = "POS_RUN_NAME"       # `pos run --name`; the scheduler resolves names through it


def socket_path(pid: int) -> str:
    """The control socket of the agent inside process `pid`."""
    return SOCKET_TEMPLATE.format(pid=pid)


class HalfRestored(PosError):
    """An on-demand restore failed after the application was released: some buffers hold the
    image's bytes and others their old ones. The calls that need the others stay held, and the
    server ends the process after answering, so that it never computes on that mix (a failed
    CRIU restore ends its tree the same way)."""
