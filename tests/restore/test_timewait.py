"""A killed job's closed connections (TIME_WAIT) hold its listening ports for a minute; the
restore ends them (pos/restore/timewait.py) so that it can listen there again at once."""

import os
import socket
import time

import pytest

from pos.restore import timewait

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="SOCK_DESTROY needs root")


def left_in_time_wait() -> int:
    """A listening port whose server side closed first: the server's end of the connection
    stays in TIME_WAIT, holding the port."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()
    client.settimeout(10)
    assert client.recv(1) == b""      # the server's close reached the client: it closed first
    client.close()
    srv.close()
    return port


def test_the_ports_of_closed_connections_are_free_at_once() -> None:
    port = left_in_time_wait()
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", port))       # what CRIU met: "Address already in use"
    said: list[str] = []
    t = time.monotonic()
    assert timewait.free([port], 5, said.append) == 1
    assert time.monotonic() - t < 1 and said == []
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()


def test_only_the_named_ports_are_touched() -> None:
    port = left_in_time_wait()
    other = left_in_time_wait()
    timewait.free([port], 5, lambda _: None)
    assert [m["idiag_sport"] for _, m in timewait.held([other])] == [other]
    assert timewait.held([port]) == []


def test_no_ports_no_work() -> None:
    assert timewait.free([], 5, lambda _: None) == 0
