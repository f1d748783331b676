#!/usr/bin/env bash
# Set up this host for pos, idempotently: system packages (bcc, kernel headers, compiler),
# the kernel-headers link bcc looks for, tracefs, and the virtual environment .venv with pos
# installed in it. Needs root (apt-get, /lib/modules, mount). Debian 12+ and Ubuntu 22.04+.
#
#   scripts/setup.sh          # then: .venv/bin/pos doctor
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf 'setup: %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { echo "setup: needs root (apt-get, mounts): run it with sudo" >&2; exit 2; }
. /etc/os-release
kernel=$(uname -r)

# ---- system packages -----------------------------------------------------------------------
pkgs=(python3-bpfcc python3-venv python3-dev gcc make)
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
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi
# bcc is pure Python over libbcc, installed by apt for the system Python: expose that one
# package (not all of dist-packages) to the venv.
bcc_dir=$("$py" -c 'import bcc, os; print(os.path.dirname(os.path.dirname(bcc.__file__)))')
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p .venv/distro
ln -sfn "$bcc_dir/bcc" .venv/distro/bcc
echo "$PWD/.venv/distro" > "$site/pos-distro-bcc.pth"
.venv/bin/python -c 'import bcc' || { echo "setup: bcc is not importable from .venv" >&2; exit 1; }
log "ready: .venv/bin/pos"
