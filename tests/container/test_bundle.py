"""The podman bundle for an offline GPU machine (scripts/podman-debs.sh, scripts/podman-setup.sh),
run for real here as that machine would run it: downloaded, unpacked into a folder of its own,
and run in a mount namespace where this host's podman, conmon, runc, crun, their configuration
and every library the bundle brings are hidden (the host's glibc and libseccomp stay: runc's
`runc init` loads libseccomp without the wrapper's environment). It must run a container,
checkpoint it through the CRIU it was given (--export), and restore it twice (--import)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pos.process import criu
from tests.conftest import ROOT
from workloads import base_image
from workloads.base_image import IMAGE, ULIMITS

LIBS = "/usr/lib/x86_64-linux-gnu"
KEPT = ("libc.so", "libm.so", "libseccomp.so")      # what the GPU machine's own system has

# Run in the new mount namespace: hide with MS_BIND over each path (a tmpfs over folders), then
# exec the script. One process does all mounts: `mount` itself needs libraries hidden here.
HIDE = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
MS_BIND = 4096
for path in sys.argv[2:]:
    folder = os.path.isdir(path)
    if libc.mount(b"none" if folder else b"/dev/null", path.encode(),
                  b"tmpfs" if folder else None, 0 if folder else MS_BIND, None) != 0:
        sys.exit(f"hiding {path}: {os.strerror(ctypes.get_errno())}")
os.execv("/bin/bash", ["bash", "-euc", sys.argv[1]])
"""

# The test in the namespace, with the bundle's podman first on a PATH that has no other. /usr
# goes in without the mounts that hide things under it (CRIU cannot dump a bind of /dev/null).
SCRIPT = """
podman info --format '{{{{.Host.Conmon.Path}}}} {{{{.Host.OCIRuntime.Path}}}}'
podman import {tar} {image} >/dev/null
podman run -d --name c1 {ulimits} -v /usr:/usr:ro,bind {image} /usr/bin/python3 -c '
import itertools, os, time
for i in itertools.count(1):
    with open("/tmp/n.new", "w") as f:
        f.write(str(i))
    os.replace("/tmp/n.new", "/tmp/n")
    time.sleep(0.05)
' >/dev/null
sleep 0.5
podman container checkpoint --export {archive} c1 >/dev/null
echo "saved $(cat "$(podman mount c1)/tmp/n")"
podman rm --force --time 0 c1 >/dev/null
for c in c2 c3; do podman container restore --import {archive} --name $c >/dev/null; done
sleep 0.5
for c in c2 c3; do echo "$c $(podman exec $c cat /tmp/n)"; done
podman rm --force --time 0 c2 c3 >/dev/null
"""


def hidden(root: Path) -> list[str]:
    """What this host has that the GPU machine has not: podman and its helpers, their
    configuration, and the libraries the bundle brings (by their names in the bundle)."""
    paths = [p for p in ("/usr/bin/podman", "/usr/bin/conmon", "/usr/sbin/runc", "/usr/bin/crun")
             if os.path.isfile(p)]
    paths += [d for d in ("/etc/containers", "/usr/share/containers", "/usr/lib/podman")
              if os.path.isdir(d)]
    bundled = {p.name for d in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu")
               for p in (root / "tree" / d).glob("lib*.so*")}
    paths += sorted(f"{LIBS}/{n}" for n in bundled
                    if os.path.exists(f"{LIBS}/{n}") and not n.startswith(KEPT))
    # a link is hidden through its target (a bind mount follows it): each target once
    return sorted({os.path.realpath(p) for p in paths})


def test_the_podman_bundle_runs_saves_and_restores_a_container_without_the_hosts_podman(
        tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the bundle's podman runs rootful: run the tests as root", pytrace=False)
    debs, root = tmp_path / "debs", tmp_path / "podman"
    r = subprocess.run([str(ROOT / "scripts" / "podman-debs.sh"), str(debs)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    size = sum(p.stat().st_size for p in debs.iterdir())
    # carried beside CRIU (~7 MiB) and the wheels (~12 MiB) within the 64 MiB a transfer holds
    assert size < 24 << 20, f"the podman bundle grew to {size / 2**20:.1f} MiB"
    logged = tmp_path / "criu.log"            # the CRIU given, logging each call
    given = tmp_path / "criu"
    given.write_text(f'#!/bin/sh\necho "$*" >> {logged}\nexec {criu.find().path} "$@"\n')
    given.chmod(0o755)
    r = subprocess.run([str(ROOT / "scripts" / "podman-setup.sh"), str(debs), str(root),
                        str(given)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    script = SCRIPT.format(tar=base_image.rootfs_tar(tmp_path), image=IMAGE,
                           ulimits=" ".join(ULIMITS), archive=tmp_path / "c1.tar")
    env = {"PATH": f"{root}/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
                        HIDE, script, *hidden(root)], capture_output=True, text=True, env=env,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split("\n")
    assert lines[0] == f"{root}/bin/conmon {root}/bin/runc", lines[0]
    saved = int(lines[1].removeprefix("saved "))
    copies = dict(ln.split() for ln in lines[2:4])
    # each copy counts on from where the original was saved, not from 1
    assert all(saved < int(v) < saved + 200 for v in copies.values()), (saved, copies)
    calls = logged.read_text().splitlines()
    assert len(calls) >= 3 and all(c.startswith("swrk") for c in calls), calls
