# CRIU's start with and without its kernel-feature cache (/run/criu.kdat, kept only on a tmpfs)
source .device/setup.sh >/dev/null 2>&1
setsid sleep 1000 < /dev/null > /dev/null 2>&1 &
p=$!; sleep 0.3
dumps() {  # dumps LABEL
  for i in 1 2 3 4 5; do d=$(mktemp -d); t0=$(date +%s%N); $POS_CRIU dump -t $p -D $d -o log -v4 --leave-running; rc=$?; t1=$(date +%s%N)
    echo "$1 dump $i rc=$rc total_ms=$(( (t1-t0)/1000000 )) to_dumping=$(grep -m1 'Dumping processes' $d/log | cut -c2-10) kdat=$(grep -m1 -o 'Loaded kdat cache\|does not exist' $d/log)"; rm -rf $d; done; }
rm -f /run/criu.kdat.tmp
dumps run-on-disk
unshare -m bash -c "mount -t tmpfs -o mode=755 tmpfs /run && $(declare -f dumps); p=$p; POS_CRIU=$POS_CRIU; dumps run-tmpfs; ls -la /run"
kill $p
