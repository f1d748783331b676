O=$OUT; mkdir -p $O/v $O/p1 $O/p2 $O/p3
export POS_BENCH_COMMIT=fc2035c27767998290de67d589169b80690676d5
clean() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 $p 2>/dev/null; done; sleep 1; rm -rf /var/tmp/pos-perf /var/tmp/pos-scale-test-* /tmp/pytest-of-root /tmp/pos-torchrun /run/pos/dump/* /dev/shm/pos-scale* /dev/shm/pos-perf*; }
OUT=$O/v POS_VMM_ARGS="--buffers 4561 --mib 20 --ranges --repeat 3" timeout 120 bash bench/device.sh vmm > $O/v.log 2>&1
clean
OUT=$O/p1 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+nostw timeout 170 bash bench/device.sh perf > $O/p1.log 2>&1
clean
OUT=$O/p2 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+late+nostw timeout 170 bash bench/device.sh perf > $O/p2.log 2>&1
clean
OUT=$O/p3 POS_BENCH_PACK=0 POS_PERF_CASES=0.6+expand+shm+nostw timeout 150 bash bench/device.sh perf > $O/p3.log 2>&1
clean
cd $O && tar czf all.tgz v p1 p2 p3 *.log && rm -rf v p1 p2 p3
