O=$OUT; mkdir -p $O/h $O/p1
export POS_BENCH_COMMIT=b42c8841ba5caf749b81d2b5ec45dcc0e1b110ff
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 $p 2>/dev/null; done; sleep 1; rm -rf /var/tmp/pos-perf /var/tmp/pos-scale-test-* /tmp/pytest-of-root /tmp/pos-torchrun /run/pos/dump/* /dev/shm/pos-scale* /dev/shm/pos-perf*; }
OUT=$O/h POS_HOSTCOPY_GIB=32 POS_HOSTCOPY_WAYS=bounce,bounce-faulted timeout 200 bash bench/device.sh hostcopy > $O/h.log 2>&1
clean
OUT=$O/p1 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+nostw timeout 300 bash bench/device.sh perf > $O/p1.log 2>&1
clean
cd $O && tar czf all.tgz h p1 h.log p1.log && rm -rf h p1
