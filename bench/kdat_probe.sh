#!/usr/bin/env bash
# CRIU's start with and without its kernel-feature cache (/run/criu.kdat, which CRIU keeps only
# on a tmpfs): five dumps (--leave-running) of a sleeping process each way, one line a dump, its
# milliseconds in all and until CRIU starts on the process (`Dumping processes` in its log).
#   1. this host as it is (pos's cache taken away first);
#   2. after pos keeps the cache (pos/process/kdat.py), in this host's namespaces;
#   3. where /run is not a tmpfs: in a mount namespace whose /run is one, where CRIU keeps its own
#      (on the H200 host those dumps failed after the part measured: the process was not in
#      that namespace).
#
#   bash bench/device.sh kdat      # on the GPU machine; here: sudo bash bench/kdat_probe.sh
set -u
criu=${POS_CRIU:-criu}
setsid sleep 1000 < /dev/null > /dev/null 2>&1 &
p=$!
trap 'kill $p' EXIT
sleep 0.3
dumps() {  # dumps LABEL
  for i in 1 2 3 4 5; do
    d=$(mktemp -d); t0=$(date +%s%N)
    $criu dump -t "$p" -D "$d" -o log -v4 --leave-running; rc=$?; t1=$(date +%s%N)
    echo "$1 dump $i rc=$rc total_ms=$(( (t1 - t0) / 1000000 ))" \
         "to_dumping_s=$(grep -m1 'Dumping processes' "$d/log" | cut -c2-10)" \
         "cache=$(grep -m1 -o 'Loaded kdat cache\|does not exist' "$d/log")"
    rm -rf "$d"
  done
}
echo "/run: $(stat -f -c %T /run)"
umount /run/criu.kdat /run/pos/kdat 2>/dev/null
dumps as-is
python3 -c "from pos.process import criu, kdat; c = criu.find(); print(kdat.keep(c.path, c.version_text))"
dumps pos-kept
umount /run/criu.kdat /run/pos/kdat 2>/dev/null
if [ "$(stat -f -c %T /run)" != tmpfs ]; then
  unshare -m bash -c "mount -t tmpfs -o mode=755 tmpfs /run && $(declare -f dumps); p=$p criu=$criu; dumps run-tmpfs"
fi
