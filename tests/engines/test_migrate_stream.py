"""The migration's file stream (pos/engines/migrate.py): a file's bytes arrive whole, in
pieces, with the next message intact behind them; a size that is no size is refused; messages
are typed and versioned (pos/engines/migrate_protocol.py)."""

import socket
import threading
from pathlib import Path

import pytest

from pos.engines import migrate
from pos.errors import PosError
from pos.engines import migrate_protocol as proto


def test_a_file_is_sent_and_received_byte_for_byte(tmp_path: Path) -> None:
    data = bytes(range(256)) * 5000 + b"tail"
    (tmp_path / "a.bin").write_bytes(data)
    (tmp_path / "in").mkdir()
    tx, rx = socket.socketpair()
    sender = threading.Thread(target=lambda: (migrate._send_file(tx, tmp_path, "a.bin"),
                                              migrate._send(tx, proto.Manifest(2), b"{}")))
    sender.start()
    reader = migrate._Reader(rx)
    msg = reader.message()
    assert msg == proto.File("a.bin", len(data))
    reader.into(tmp_path / "in" / msg.name, msg.size)
    assert (tmp_path / "in" / "a.bin").read_bytes() == data
    assert reader.message() == proto.Manifest(2) and reader.exactly(2) == b"{}"
    sender.join()


@pytest.mark.parametrize("size", [-1, "12", None])
def test_a_size_that_is_no_size_is_refused(tmp_path: Path, size) -> None:
    tx, rx = socket.socketpair()
    with pytest.raises(PosError, match="announced x.bin with size"):
        migrate._Reader(rx).into(tmp_path / "x.bin", size)
    assert not (tmp_path / "x.bin").exists()


@pytest.mark.parametrize("line,fragment", [
    (b'{"v": 1, "kind": "Ready"}', "speaks version 1 of pos's migration, this pos version 2"),
    (b'{"kind": "Ready"}', "no migration message"),
    (b'{"file": "a", "size": 1}', "no migration message"),
    (b'{"v": 2, "kind": "Exec", "argv": ["sh"]}', "a migration message this pos does not know"),
    (b'{"v": 2, "kind": "File", "name": "a"}', "a migration message this pos does not know"),
    (b"\xff\xfe", "no migration message"),
])
def test_a_message_of_another_version_or_none_is_refused(line: bytes, fragment: str) -> None:
    with pytest.raises(PosError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        proto.decode(line)


def test_a_failure_of_the_other_host_is_its_sentence_and_exit_code() -> None:
    failed = proto.Failed("no room", "free some", 2, "/var/lib/pos/x")
    assert proto.decode(proto.encode(failed)) == failed
    with pytest.raises(PosError, match="the other host: no room") as e:
        proto.expect(failed, proto.Ready)
    assert e.value.fix == "free some" and e.value.exit_code == 2
    assert proto.decode(proto.encode(proto.Hello([1, 2], True))) == proto.Hello([1, 2], True)


def test_a_restore_that_failed_there_is_said_here_with_its_exit_code() -> None:
    from pos.engines.migrate import restored_there

    assert restored_there(proto.Restored(77), "hostb", 42) == proto.Restored(77)
    with pytest.raises(PosError, match="hostb could not restore PID 42: no GPU") as e:
        restored_there(proto.Failed("no GPU", "add one", 2, "/var/lib/pos/in/x"), "hostb", 42)
    assert e.value.exit_code == 2 and "(/var/lib/pos/in/x)" in e.value.fix
