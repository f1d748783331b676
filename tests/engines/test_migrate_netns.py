"""`pos migrate --to HOST` between two "hosts" made of network namespaces (pyroute2): the
counter is dumped in one, its pages stream through CRIU's page server over TLS into the other,
where it is restored and counts on from the right value. Only a host that holds the migration
key is heard: a plain TCP client and a host with another key are refused, and nothing is
written or restored for them."""

import json
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from pos.image import names
from tests.conftest import ROOT
from tests.engines.conftest import COUNTER, Counter, lines, listening, wait_for


@pytest.fixture
def hosts(criu_ready: None):
    """Two network namespaces joined by a veth pair: 10.77.0.1 (a) and 10.77.0.2 (b)."""
    from pyroute2 import IPRoute, NetNS, netns

    tag = uuid.uuid4().hex[:6]
    names = (f"posa{tag}", f"posb{tag}")
    for n in names:
        netns.create(n)
    with IPRoute() as ip:
        ip.link("add", ifname=f"va{tag}", kind="veth", peer=f"vb{tag}")
        for n, dev in zip(names, (f"va{tag}", f"vb{tag}")):
            ip.link("set", index=ip.link_lookup(ifname=dev)[0], net_ns_fd=n)
    for i, (n, dev) in enumerate(zip(names, (f"va{tag}", f"vb{tag}"))):
        with NetNS(n) as ns:
            idx = ns.link_lookup(ifname=dev)[0]
            ns.addr("add", index=idx, address=f"10.77.0.{i + 1}", prefixlen=24)
            ns.link("set", index=idx, state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
    yield names
    for n in names:
        netns.remove(n)


def in_ns(name: str) -> list[str]:
    return ["nsenter", f"--net=/run/netns/{name}"]


FORGED = ("import socket, sys\n"
          "s = socket.create_connection(('10.77.0.2', 7070), timeout=20)\n"
          "s.sendall(b'{\"v\": 1, \"kind\": \"Hello\", \"pids\": [1], \"concurrent\": true}\\n')\n"
          "try:\n"
          "    print(repr(s.recv(100)))\n"
          "except OSError as e:\n"
          "    print(type(e).__name__)\n")


def test_migrate_to_another_host(tmp_path: Path, hosts, counters) -> None:
    a, b = hosts
    env = {**os.environ, "POS_WATCHDOG_LOG": str(tmp_path / "wd.log"),
           "POS_DB": str(tmp_path / "pos.db"), "POS_MIGRATE_KEY": str(tmp_path / "key")}
    pos = [sys.executable, "-m", "pos.cli", "migrate"]
    for folder in ("key", "other-key"):
        made = subprocess.run([*pos, "--new-key", "--key", str(tmp_path / folder)], cwd=ROOT,
                              env=env, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        assert oct((tmp_path / folder / "key.pem").stat().st_mode)[-3:] == "600"
    c = Counter.__new__(Counter)      # a counter started inside host a
    c.path, c.files = tmp_path / "count", [tmp_path / "count"]
    c.proc = subprocess.Popen([*in_ns(a), sys.executable, str(COUNTER), str(c.path)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    # nsenter execs the counter: same PID
    c.pid = c.proc.pid
    counters.append(c)
    wait_for(lambda: len(lines(c.path)) >= 5, what="the counter")
    c.tree = c.pids()
    threading.Thread(target=c.proc.wait, daemon=True).start()
    rx = subprocess.Popen([*in_ns(b), *pos, "--listen", "-D", str(tmp_path / "in"), "--address",
                           "10.77.0.2", "--port", "7070"], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: listening(7070, tuple(in_ns(b))) or rx.poll() is not None,
             what="the listener in host b")
    # a client without the key: a forged hello in plain TCP, then pos with another key
    forged = subprocess.run([*in_ns(a), sys.executable, "-c", FORGED], capture_output=True,
                            text=True, timeout=60)
    assert forged.stdout.strip() in ("b''", "ConnectionResetError"), (forged.stdout, forged.stderr)
    wrong = subprocess.run([*in_ns(a), *pos, str(c.pid), "--to", "10.77.0.2:7070", "--key",
                            str(tmp_path / "other-key")], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
    assert wrong.returncode == 1, (wrong.stdout, wrong.stderr)
    said = wrong.stderr.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(
        "Error: 10.77.0.2:7070 did not authenticate as a holder of this host's migration key"), said
    assert rx.poll() is None and not (tmp_path / "in").exists()
    assert not names.partial(tmp_path / "in").exists()
    at = len(lines(c.path))
    wait_for(lambda: len(lines(c.path)) > at + 5, what="the counter, untouched, counting on")
    tx = subprocess.run([*in_ns(a), *pos, str(c.pid), "--to", "10.77.0.2:7070", "--json"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    out, err = rx.communicate(timeout=120)
    assert tx.returncode == 0, (tx.stdout, tx.stderr, out, err)
    assert rx.returncode == 0, (out, err)
    assert f"restored PID {c.pid}" in out
    assert out.count("refused a connection from 10.77.0.1: it did not authenticate with this "
                     "host's migration key") == 2, out
    # --json: the sender's report is one JSON object, its steps' lines went to stderr
    report = json.loads(tx.stdout)
    assert {k: report[k] for k in ("pid", "host", "restored_pid")} == {
        "pid": c.pid, "host": "10.77.0.2:7070", "restored_pid": c.pid}
    # where the time went: the checkpoint (its own steps too), the send, the restore there
    assert report["timings"]["send"] >= 0 and report["timings"]["there"] > 0
    assert "checkpoint.dump" in report["timings"]
    assert "migrated to 10.77.0.2" in tx.stderr
    at = len(lines(c.path))
    wait_for(lambda: len(lines(c.path)) > at + 20, what="the migrated counter")
    values = lines(c.path)
    assert values == list(range(1, len(values) + 1))
    # it runs in host b now
    assert os.stat(f"/proc/{c.pid}/ns/net").st_ino == os.stat(f"/run/netns/{b}").st_ino
    assert (tmp_path / "in" / names.MANIFEST).exists()
    # the pages came through CRIU's page server over TLS with the same key
    assert "tls: TLS handshake completed" in (tmp_path / names.PAGE_SERVER_LOG).read_text()
    assert any((tmp_path / "in").glob("pages-*.img"))
