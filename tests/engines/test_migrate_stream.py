"""The migration's file stream (pos/engines/migrate.py): a file's bytes arrive whole, in
pieces, with the next message intact behind them; a size that is no size is refused."""

import socket
import threading
from pathlib import Path

import pytest

from pos.engines import migrate
from pos.errors import PosError


def test_a_file_is_sent_and_received_byte_for_byte(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000 + b"tail"
    (tmp_path / "a.bin").write_bytes(data)
    (tmp_path / "in").mkdir()
    tx, rx = socket.socketpair()
    sender = threading.Thread(target=lambda: (migrate._send_file(tx, tmp_path, "a.bin"),
                                              migrate._send(tx, {"manifest": 2}, b"{}")))
    sender.start()
    reader = migrate._Reader(rx)
    msg = reader.message()
    assert msg == {"file": "a.bin", "size": len(data)}
    reader.into(tmp_path / "in" / msg["file"], msg["size"])
    assert (tmp_path / "in" / "a.bin").read_bytes() == data
    assert reader.message() == {"manifest": 2} and reader.exactly(2) == b"{}"
    sender.join()


@pytest.mark.parametrize("size", [-1, "12", None])
def test_a_size_that_is_no_size_is_refused(tmp_path: Path, size) -> None:
    tx, rx = socket.socketpair()
    with pytest.raises(PosError, match="announced x.bin with size"):
        migrate._Reader(rx).into(tmp_path / "x.bin", size)
    assert not (tmp_path / "x.bin").exists()
