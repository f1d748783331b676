#!/usr/bin/env bash
# Download CRIU 4.2 and the libraries it runs with, as .deb files, from Debian forky into DIR
# (scripts/debian-debs.sh: a private apt configuration, this host's Debian mirror).
# Used by scripts/setup.sh, and for the offline GPU machine, whose bundle's CRIU 4.1 cannot
# dump TCP/UDP sockets on Linux >= 6.16 (CRIU issue 2718):
#
#   scripts/criu-debs.sh .device/criu     # then carry .device; .device/setup.sh unpacks it
#   scripts/criu-debs.sh --mirror         # only print the Debian mirror it would use
set -euo pipefail
dest=${1:?usage: scripts/criu-debs.sh DIR|--mirror}
export POS_DEBS_NAME=criu-debs
[ "$dest" = --mirror ] && exec "$(dirname "$0")/debian-debs.sh" --mirror
exec "$(dirname "$0")/debian-debs.sh" forky "$dest" criu libcompel1 libc6 libprotobuf-c1 \
  libnl-3-200 libnet9 libnftables1 libgnutls30t64 libbsd0 libmd0 libuuid1 libjansson4 libmnl0 \
  libnftnl11 libxtables12 libp11-kit0 libidn2-0 libunistring5 libtasn1-6 libnettle8t64 \
  libhogweed6t64 libgmp10 libffi8 libgcc-s1 libcap2
