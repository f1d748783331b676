#!/usr/bin/env bash
# Download rootful podman 4.3 (Debian 12's, the one pos's container tests run), runc, conmon,
# the libraries they load beyond glibc, and containers-common's configuration files, as .deb
# files, into DIR (scripts/debian-debs.sh: a private apt configuration, this host's Debian
# mirror). For an offline GPU machine without podman: scripts/podman-setup.sh unpacks them
# there and runs podman with these libraries on the host's own glibc (>= 2.36).
# No netavark or aardvark-dns: the containers pos runs there have `--network none`.
#
#   scripts/podman-debs.sh .device/podman   # then carry .device; bench/device.sh containers
#   scripts/podman-debs.sh --mirror         # only print the Debian mirror it would use
set -euo pipefail
dest=${1:?usage: scripts/podman-debs.sh DIR|--mirror}
export POS_DEBS_NAME=podman-debs
[ "$dest" = --mirror ] && exec "$(dirname "$0")/debian-debs.sh" --mirror
# podman: libsubid4 .. libbz2-1.0; conmon: libglib2.0-0 .. liblz4-1; runc: libseccomp2
exec "$(dirname "$0")/debian-debs.sh" bookworm "$dest" podman conmon runc \
  golang-github-containers-common golang-github-containers-image \
  libsubid4 libgpgme11 libseccomp2 libdevmapper1.02.1 libaudit1 libselinux1 libsemanage2 \
  libcrypt1 libpam0g libassuan0 libgpg-error0 libudev1 libcap-ng0 libpcre2-8-0 libsepol2 \
  libbz2-1.0 libglib2.0-0 libsystemd0 libcap2 libgcrypt20 liblzma5 libzstd1 liblz4-1
