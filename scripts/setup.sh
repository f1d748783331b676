#!/usr/bin/env bash
# Set up this host for pos, idempotently: system packages (bcc, kernel headers, compiler),
# the kernel-headers link bcc looks for, tracefs, CRIU >= 4 in /opt/pos/criu, podman and runc
# using that CRIU (for containers), the virtual environment .venv with pos installed in it,
# and pos's preload library (libposhook.so).
# Needs root (apt-get, /lib/modules, mount).
# Debian 12+ and Ubuntu 22.04+.
#
#   scripts/setup.sh          # then: .venv/bin/pos doctor
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf 'setup: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { echo "setup: needs root (apt-get, mounts): run it with sudo" >&2; exit 2; }
. /etc/os-release
kernel=$(uname -r)

# ---- system packages -----------------------------------------------------------------------
# iptables: CRIU locks established TCP connections with it during a dump (--tcp-established)
# libseccomp2: `pos run`'s filter that turns io_uring off for the job (pyseccomp loads it)
pkgs=(python3-bpfcc python3-venv python3-dev gcc make iproute2 iptables libseccomp2
      debian-archive-keyring)
pkgs+=(openssl)   # makes the key two hosts hold to migrate between them (pos migrate --new-key)
if apt-cache show "linux-headers-$kernel" >/dev/null 2>&1; then
  pkgs+=("linux-headers-$kernel")
elif [ "${ID:-}" = ubuntu ]; then
  pkgs+=(linux-headers-generic)
else
  pkgs+=(linux-headers-amd64)   # no headers for this (custom) kernel: the distribution's are
fi                              # enough for uprobe programs, which use no kernel internals
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || true   # a stale list is not fatal here; install names the real error
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# ---- kernel headers where bcc looks for them -------------------------------------------------
if [ ! -e "/lib/modules/$kernel/build/include" ] && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
  build=$(ls -d /usr/src/linux-headers-*-amd64 /usr/src/linux-headers-*-generic 2>/dev/null \
          | sort -V | tail -1 || true)
  [ -n "$build" ] || { echo "setup: no kernel headers under /usr/src after install" >&2; exit 1; }
  common=$(ls -d "${build%-*}-common" 2>/dev/null || echo "$build")
  mkdir -p "/lib/modules/$kernel"
  ln -sfn "$build" "/lib/modules/$kernel/build"
  ln -sfn "$common" "/lib/modules/$kernel/source"
  log "linked /lib/modules/$kernel/build -> $build"
fi
mountpoint -q /sys/kernel/tracing || mount -t tracefs nodev /sys/kernel/tracing || true
mountpoint -q /sys/kernel/debug || mount -t debugfs nodev /sys/kernel/debug || true

# ---- CRIU >= 4 in a private folder ------------------------------------------------------------
# Bookworm's CRIU 3.17 fails on recent kernels (vDSO layout), and trixie's 4.1 cannot dump any
# TCP/UDP socket on Linux >= 6.16 (CRIU issue 2718); 4.2 from Debian forky works. It runs
# through its own glibc's loader so that the system's libraries stay as they are. The debs come
# through a private apt configuration: the system's sources are never changed. pos finds the
# wrapper /opt/pos/criu/criu by default (POS_CRIU and a criu >= 4 on the PATH come first).
criu_home=/opt/pos/criu
criu_ok() { "$criu_home/criu" --version 2>/dev/null | grep -Eq '^Version: (4\.([2-9]|[1-9][0-9])|([5-9]|[1-9][0-9])\.)'; }
if ! criu_ok; then
  log "installing CRIU from Debian forky into $criu_home"
  rm -rf "$criu_home.new" && mkdir -p "$criu_home.new/root"
  scripts/criu-debs.sh "$criu_home.new/debs"
  for d in "$criu_home.new"/debs/*.deb; do dpkg -x "$d" "$criu_home.new/root"; done
  rm -rf "$criu_home.new/debs"
  r=$criu_home/root
  printf '#!/bin/sh\n# CRIU from Debian forky with its own glibc (written by pos scripts/setup.sh)\nexec %s/usr/lib64/ld-linux-x86-64.so.2 --library-path %s/usr/lib/x86_64-linux-gnu %s/usr/sbin/criu "$@"\n' \
    "$r" "$r" "$r" > "$criu_home.new/criu"
  chmod 755 "$criu_home.new/criu"
  rm -rf "$criu_home" && mv "$criu_home.new" "$criu_home"
  criu_ok || { echo "setup: $criu_home/criu does not run (criu --version failed)" >&2; exit 1; }
  log "CRIU: $("$criu_home/criu" --version | head -1)"
fi

# ---- containers: rootful podman through runc, with the CRIU above ------------------------------
# pos saves containers through podman's own checkpoint (pos/container/). Debian 12's crun is
# built without CRIU, so podman runs containers through runc, which runs `criu` from the PATH:
# pos's CRIU is linked there. Without systemd as PID 1 podman needs cgroupfs and a file for its
# events. `pos cdi` (run by the tests) writes the agent's CDI spec into /etc/cdi.
cpkgs=(podman runc conmon netavark aardvark-dns)   # netavark: podman 4.3's network backend
cmissing=()
for p in "${cpkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || cmissing+=("$p"); done
if [ ${#cmissing[@]} -gt 0 ]; then
  log "installing ${cmissing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq || true
  apt-get install -y -qq --no-install-recommends "${cmissing[@]}" >/dev/null
fi
[ "$(readlink /usr/local/sbin/criu 2>/dev/null)" = "$criu_home/criu" ] \
  || { mkdir -p /usr/local/sbin && ln -sfn "$criu_home/criu" /usr/local/sbin/criu; }
conf=/etc/containers/containers.conf.d/50-pos.conf
want='[engine]
runtime = "runc"'
if [ "$(cat /proc/1/comm 2>/dev/null)" != systemd ]; then
  want="$want
cgroup_manager = \"cgroupfs\"
events_logger = \"file\""
fi
if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
  mkdir -p "$(dirname "$conf")" && printf '%s\n' "$want" > "$conf"
  log "wrote $conf"
fi

# ---- the virtual environment -----------------------------------------------------------------
# The distribution's python3 is the one bcc's Python package was built for.
py=/usr/bin/python3
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c 'import sys' 2>/dev/null; then
  log "creating .venv"
  rm -rf .venv
  "$py" -m venv .venv
fi
stamp=.venv/.pos-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  log "installing pos and its dependencies into .venv"
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # setuptools' banner about editable installs (a warning of its build backend) says nothing
  # to act on here
  PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
# bcc is pure Python over libbcc, installed by apt for the system Python: expose that one
# package (not all of dist-packages) to the venv, by its real directory (a path file that
# names another checkout's .venv/distro, left in the system Python's site by an older setup,
# would otherwise make the link point at itself).
for d in $("$py" -c 'import site; print(" ".join(site.getsitepackages()))'); do
  if [ -f "$d/pos-distro-bcc.pth" ]; then
    rm -f "$d/pos-distro-bcc.pth"
    log "removed $d/pos-distro-bcc.pth"
  fi
done
bcc_dir=$("$py" -c 'import bcc, os; print(os.path.dirname(os.path.realpath(bcc.__file__)))')
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
case "$site" in
  "$PWD/.venv/"*) ;;
  *) echo "setup: .venv/bin/python is not this checkout's virtual environment (its packages" \
          "go to $site): remove .venv and run this again" >&2
     exit 1 ;;
esac
mkdir -p .venv/distro
ln -sfn "$bcc_dir" .venv/distro/bcc
echo "$PWD/.venv/distro" > "$site/pos-distro-bcc.pth"
.venv/bin/python -c 'import bcc' || { echo "setup: bcc is not importable from .venv" >&2; exit 1; }
# the agent that `pos run` preloads into jobs, and the image chunk reader, built with the
# distribution's compiler
.venv/bin/python -m pos.native >/dev/null
log "ready: .venv/bin/pos"
