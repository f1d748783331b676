O=$OUT; mkdir -p $O/p1 $O/p2 $O/p3 $O/p4
export POS_BENCH_COMMIT=b18d0aff5aea8c7404946509bff0874e36a75a9f
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 $p 2>/dev/null; done; sleep 1; rm -rf /var/tmp/pos-perf /var/tmp/pos-scale-test-* /tmp/pytest-of-root /tmp/pos-torchrun /run/pos/dump/* /dev/shm/pos-scale* /dev/shm/pos-perf*; }
OUT=$O/p1 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+nostw timeout 150 bash bench/device.sh perf > $O/p1.log 2>&1
clean
OUT=$O/p2 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+late+nostw timeout 130 bash bench/device.sh perf > $O/p2.log 2>&1
clean
OUT=$O/p3 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+nostw timeout 130 bash bench/device.sh perf > $O/p3.log 2>&1
clean
OUT=$O/p4 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+late+nostw timeout 130 bash bench/device.sh perf > $O/p4.log 2>&1
clean
cd $O && tar czf all.tgz p1 p2 p3 p4 *.log && rm -rf p1 p2 p3 p4
