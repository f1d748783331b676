#!/usr/bin/env bash
# Unpack the podman bundle (scripts/podman-debs.sh) into ROOT and make it runnable there, on a
# host without podman and without network (the offline GPU machine): ROOT/bin holds podman,
# conmon and runc, each a wrapper that runs the bundle's binary with the bundle's libraries on
# the host's own glibc, and `criu` (a link to CRIU, the one runc runs for checkpoints). Nothing
# outside ROOT is written: podman's configuration, storage and run state are ROOT's own, and
# the wrapper points podman at them (HOME too: podman looks there for its image policy),
# so a podman of the host's own is left alone.
#
#   scripts/podman-setup.sh .device/podman /opt/pos-podman /opt/pos-criu/criu
#   export PATH=/opt/pos-podman/bin:$PATH      # then `podman` is this one (pos finds it so)
#
# Rootful, through runc (pos's container support is tested with podman 4.3.1 and runc 1.1.5),
# cgroupfs and a file for events (no systemd needed), no network backend: containers run with
# `--network none`. The storage driver is overlay, or vfs where ROOT is on overlayfs itself
# (an overlay cannot sit on one). runc starts its own `runc init` with an environment of its
# making, not the wrapper's: that one loads the host's libseccomp.so.2 (apt depends on it).
set -euo pipefail
debs=${1:?usage: scripts/podman-setup.sh DEBS ROOT CRIU}
root=${2:?usage: scripts/podman-setup.sh DEBS ROOT CRIU}
criu=${3:?usage: scripts/podman-setup.sh DEBS ROOT CRIU}
ls "$debs"/podman_*.deb >/dev/null 2>&1 || { echo "podman-setup: $debs holds no podman .deb:" \
  "run scripts/podman-debs.sh $debs where there is network, and carry it" >&2; exit 2; }
[ -x "$criu" ] || { echo "podman-setup: CRIU $criu is not an executable: give the path of a" \
  "CRIU >= 4 (scripts/criu-debs.sh)" >&2; exit 2; }
mkdir -p "$root"
root=$(cd "$root" && pwd)
tree=$root/tree   # the packages' files
u=$tree/usr
rm -rf "$tree" "$root/bin" "$root/etc"
for d in "$debs"/*.deb; do dpkg -x "$d" "$tree"; done
mkdir -p "$root/bin" "$root/etc" "$root/storage" "$root/run" "$root/cni"
lib=$u/lib/x86_64-linux-gnu:$tree/lib/x86_64-linux-gnu
# wrapper NAME BINARY [EXPORTS]: ROOT/bin/NAME runs BINARY with the bundle's libraries and
# configuration (and EXPORTS, more VAR=VALUE)
wrapper() {
  cat > "$root/bin/$1" <<SH
#!/bin/sh
# $1 from pos's podman bundle (scripts/podman-setup.sh)
export LD_LIBRARY_PATH=$lib PATH=$root/bin:\$PATH ${3:-}
export CONTAINERS_CONF=$root/etc/containers.conf CONTAINERS_STORAGE_CONF=$root/etc/storage.conf
export CONTAINERS_REGISTRIES_CONF=$root/etc/registries.conf HOME=$root/home
exec $2 "\$@"
SH
  chmod 755 "$root/bin/$1"
}
wrapper podman "$u/bin/podman"
wrapper conmon "$u/bin/conmon"
# runc runs CRIU, with the options of CRIU_CONFIG_FILE: no network lock, which runs
# iptables-restore (offline GPU machines have none), as the containers have no network
wrapper runc "$u/sbin/runc" "CRIU_CONFIG_FILE=$root/etc/criu.conf"
echo "network-lock skip" > "$root/etc/criu.conf"
ln -sfn "$criu" "$root/bin/criu"
driver=overlay
[ "$(stat -f -c %T "$root/storage")" = overlayfs ] && driver=vfs
cat > "$root/etc/storage.conf" <<EOF
[storage]
driver = "$driver"
graphroot = "$root/storage"
runroot = "$root/run/storage"
EOF
cat > "$root/etc/containers.conf" <<EOF
[containers]
log_driver = "k8s-file"
netns = "none"
seccomp_profile = "$u/share/containers/seccomp.json"

[network]
network_backend = "cni"
network_config_dir = "$root/etc/cni"
cni_plugin_dirs = ["$root/cni"]

[engine]
runtime = "runc"
conmon_path = ["$root/bin/conmon"]
helper_binaries_dir = ["$root/bin"]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$root/run/events.log"
tmp_dir = "$root/run/libpod"
lock_type = "file"

[engine.runtimes]
runc = ["$root/bin/runc"]
EOF
cp "$tree/etc/containers/registries.conf" "$root/etc/registries.conf"
# podman reads its image policy from /etc/containers unless HOME has one: HOME is ROOT/home
mkdir -p "$root/home/.config/containers"
cp "$tree/etc/containers/policy.json" "$root/home/.config/containers/policy.json"
"$root/bin/podman" --version >/dev/null || { echo "podman-setup: the bundle's podman does not" \
  "run here (see its message above)" >&2; exit 1; }
