#!/usr/bin/env bash
# Download CRIU 4.2 and the libraries it runs with, as .deb files, from Debian forky into DIR,
# through a private apt configuration (the system's sources are never changed).
# Used by scripts/setup.sh, and for the offline GPU machine, whose bundle's CRIU 4.1 cannot
# dump TCP/UDP sockets on Linux >= 6.16 (CRIU issue 2718):
#
#   scripts/criu-debs.sh .device/criu     # then carry .device; .device/setup.sh unpacks it
set -euo pipefail
dest=${1:?usage: scripts/criu-debs.sh DIR}
release=forky
pkgs=(criu libcompel1 libc6 libprotobuf-c1 libnl-3-200 libnet9 libnftables1 libgnutls30t64
  libbsd0 libmd0 libuuid1 libjansson4 libmnl0 libnftnl11 libxtables12 libp11-kit0 libidn2-0
  libunistring5 libtasn1-6 libnettle8t64 libhogweed6t64 libgmp10 libffi8 libgcc-s1 libcap2)
apt_dir=$(mktemp -d)
trap 'rm -rf "$apt_dir"' EXIT
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$dest"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $release main" \
  > "$apt_dir/sources.list"
opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
      -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
apt-get "${opts[@]}" update -qq 2>&1 | grep -v '^W:' >&2 || true
rm -f "$dest"/*.deb
(cd "$dest" && apt-get "${opts[@]}" download -qq "${pkgs[@]}" 2>&1 | grep -v '^W:' >&2 || true)
for p in "${pkgs[@]}"; do
  ls "$dest/${p}_"*.deb >/dev/null 2>&1 || { echo "criu-debs: $p was not downloaded from Debian $release" >&2; exit 1; }
done
