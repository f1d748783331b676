"""The ports of a killed job, freed for its restore.

A job killed on this host leaves its closed TCP connections in TIME_WAIT for a minute, and they
hold the ports it listened on: CRIU's restore cannot bind its listening sockets again until then
("Address already in use"; NCCL's and torch's TCPStore listeners, on 2x H200). The restored job
is the same job, its connections the same ones: nothing is left for TIME_WAIT to protect. So pos
ends those connections with the kernel's SOCK_DESTROY (sock_diag), as `ss -K` does, and waits
only where the kernel refuses (built without CONFIG_INET_DIAG_DESTROY) or pos may not.
"""

import socket
import struct
import time
from typing import Callable

from pyroute2 import DiagSocket
from pyroute2.netlink import NLM_F_ACK, NLM_F_REQUEST
from pyroute2.netlink.diag import SOCK_DESTROY, SS_TIME_WAIT, inet_diag_req
from pyroute2.netlink.exceptions import NetlinkError


def _words(family: int, address: str) -> tuple[int, int, int, int]:
    """An address as inet_diag's four big-endian words."""
    raw = socket.inet_pton(family, address).ljust(16, b"\0")
    return struct.unpack(">4I", raw)


def held(ports: list[int]) -> list[tuple[int, dict]]:
    """The connections in TIME_WAIT whose local port is one of `ports` (this network
    namespace), as (family, sock_diag's message)."""
    out: list[tuple[int, dict]] = []
    with DiagSocket() as ds:
        ds.bind()
        for family in (socket.AF_INET, socket.AF_INET6):
            for m in ds.get_sock_stats(family=family, states=1 << SS_TIME_WAIT):
                if m["idiag_sport"] in ports:
                    out.append((family, m))
    return out


def end(connections: list[tuple[int, dict]]) -> int:
    """SOCK_DESTROY each connection; how many the kernel ended (one it refuses stays)."""
    ended = 0
    with DiagSocket() as ds:
        ds.bind()
        for family, m in connections:
            req = inet_diag_req()
            req["sdiag_family"], req["sdiag_protocol"] = family, socket.IPPROTO_TCP
            req["idiag_states"] = 1 << SS_TIME_WAIT
            req["idiag_sport"], req["idiag_dport"] = m["idiag_sport"], m["idiag_dport"]
            req["idiag_src"] = _words(family, m["idiag_src"])
            req["idiag_dst"] = _words(family, m["idiag_dst"])
            req["idiag_if"], req["idiag_cookie"] = m["idiag_if"], m["idiag_cookie"]
            try:
                tuple(ds.nlm_request(req, SOCK_DESTROY, NLM_F_REQUEST | NLM_F_ACK))  # a generator
                ended += 1
            except NetlinkError:      # not built in, not allowed, or already gone
                pass
    return ended


def free(ports: list[int], timeout: float, echo: Callable[[str], None]) -> int:
    """End the connections in TIME_WAIT that hold `ports`, then wait (at most `timeout`, saying
    so) for any the kernel would not end; how many were ended."""
    if not ports:
        return 0
    ended = end(held(ports))
    deadline, said = time.monotonic() + timeout, False
    while (left := sorted({m["idiag_sport"] for _, m in held(ports)})) and \
            time.monotonic() < deadline:
        if not said:
            echo(f"waiting for the old job's closed connections (TIME_WAIT) to free port(s) "
                 f"{', '.join(map(str, left))}, at most {timeout:.0f} s")
            said = True
        time.sleep(0.2)
    return ended
