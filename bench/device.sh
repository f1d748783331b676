#!/usr/bin/env bash
# One run's worth of GPU work on a GPU machine (this tree copied there, results under $OUT), so
# that its scarce minutes go to measuring: set up what the call carried, run one group, leave every result and
# log under $OUT (copy them to bench/results/ and describe them in its README afterwards).
#
#   bench/device.sh trace        # pos trace: its GPU test; counts and layouts, launch cost
#                                # (9 rounds, pinned) and the bare uprobe's, storms of 8 threads
#                                # (layout known, late)  (~8 min)
#   bench/device.sh analyze      # the validator on PyTorch and the kernel suite; its test (~6 min)
#   bench/device.sh checkpoint   # stop-the-world C/R: bit-exact tests, 1-16 GiB table  (~8 min)
#   bench/device.sh checkpoint32 # the 32 GiB row of that table, restore included       (~5 min)
#   bench/device.sh concurrent   # the concurrent engine: overhead, images, stalls, tests (~8 min)
#                                # (POS_BENCH_FILLCPU=1: bench/fill_cpu.py first, ~20 s)
#   bench/device.sh schedule     # a schedule every minute for 5 minutes, images restored (~8 min)
#   bench/device.sh restart      # what a restored process costs beyond its memory: the
#                                # context's memory, the first steps after a restore (~3 min)
#   bench/device.sh floor        # the stall's floor and the first step after a restore:
#                                # bench/floor_gpu.py (POS_FLOOR_GIB, default 16,35;
#                                # POS_FLOOR_NOSTW=1: no stop-the-world beside) (~9 min)
#   bench/device.sh scale        # jobs that fill the GPU: bench/scale_gpu.py's rows
#                                # (POS_SCALE_ROWS, default 0.3,0.6,0.6@0.92,0.9; POS_SCALE_STW=0
#                                # without the stop-the-world baseline; POS_SCALE_FAULTS=SPEC:
#                                # pos killed at each step; POS_BENCH_TEST=1: the 85% GPU test),
#                                # memory and kernel log sampled beside it (~4 min a row)
#   bench/device.sh pin          # bench/pin_probe.py: how fast this host page-locks memory
#                                # (ways and threads), the copy to it from the GPU (~2 min)
#   bench/device.sh hostcopy     # bench/hostcopy_probe.py: the copy of device memory into
#                                # host memory while a job is held, four ways, 16 threads
#                                # (POS_HOSTCOPY_GIB, default 16; POS_HOSTCOPY_WAYS: which,
#                                # in that order) (~1 min)
#   bench/device.sh anon         # bench/anon_probe.py: whose is the host memory CRIU writes
#                                # while the Llama job is frozen (its processes' smaps, while
#                                # it trains under pos run; POS_ANON_RANKS, default 1) (~2 min)
#   bench/device.sh exit         # bench/exit_probe.py: what a restoring process's end costs
#                                # (its context and memory let go, its exit), each way beside
#                                # the others (POS_EXIT_GIB of device memory, default 16) (~1 min)
#   bench/device.sh export       # bench/export_probe.py: whether the driver's properties of
#                                # an allocation say, before an export, that its own restore
#                                # made the allocation unexportable (~1 min)
#   bench/device.sh drain        # bench/drain_probe.py: how fast the ring drains into an image
#                                # in /dev/shm while the GPU copies into it, two stages (hash,
#                                # then write) against one pass (POS_DRAIN_GIB, default 16;
#                                # POS_DRAIN_DEST: folders, default /dev/shm; POS_DRAIN_WAYS:
#                                # only these; POS_DRAIN_HUGETLB=2M,1G: hugetlbfs folders of
#                                # those page sizes mounted, their pages reserved, and added
#                                # to the folders) (~1 min a folder)
#   bench/device.sh criudest     # bench/criu_dest_probe.py: CRIU's frozen dump of a process's
#                                # 1.4 GB into /dev/shm and into pos's staging tmpfs, on the
#                                # host as it is, beside 60 GiB held in /dev/shm, after (~2 min)
#   bench/device.sh kdat         # bench/kdat_probe.sh: CRIU's start with and without its
#                                # kernel-feature cache, and with pos's (~10 s)
#   bench/device.sh vmm          # bench/vmm_probe.py: the driver's calls for each buffer that
#                                # the take, the hoist and the remap make, one thread against
#                                # several (POS_VMM_ARGS: e.g. "--index FILE": an image's
#                                # buffer sizes; "--buffers 4561 --mib 20 --ranges": pos's
#                                # mapping into one range against one range each) (~1 min)
#   bench/device.sh tensormap    # bench/tensormap_probe.py: whether a TMA descriptor holds its
#                                # tensor's address as a plain word, which the gate reads (~10 s)
#   bench/device.sh attach       # bench/attach_probe.py: what asking NVML about idle GPUs
#                                # costs (every GPU, one, side by side) and whether a CUDA
#                                # start then finds its GPU attached; pos's listing beside the
#                                # refill's context (POS_ATTACH_WAYS: which ways) (~1 min)
#   bench/device.sh perf         # bench/perf_gpu.py: where a checkpoint's and a restore's
#                                # seconds go, each case beside its baseline in the same run
#                                # (POS_PERF_CASES, default 0.3+pinall+nostw,0.3+nostw,
#                                # 0.3+shadow8+nostw: scale_gpu.py's specs), perf.json (~6 min)
#   bench/device.sh nccl         # (four GPUs) DDP with NCCL's defaults at POS_NCCL_RANKS
#                                # (default "2 4") ranks, either engine: refused untouched,
#                                # the job running on exact (POS_NCCL_DEFAULT_ENGINES: which
#                                # engines, default stw,concurrent); then over sockets, concurrent,
#                                # at POS_NCCL_SOCKET_RANKS (default "4 1") ranks: the stall's
#                                # growth with the ranks, each rank's host memory (~8 min)
#   bench/device.sh serve        # inference servers started warm: bench/serve_gpu.py
#                                # (POS_SERVE_MODELS, default gpt2-large,llama-7b;
#                                # POS_SERVE_CASES, default stw,concurrent,concurrent-lazy,
#                                # concurrent-service,clone; POS_SERVE_SERVICE_ENV: the
#                                # restore service's settings, e.g. POS_LAZY_PAGES=1;
#                                # POS_SERVE_CLONES: instances of the clone case, default 0;
#                                # also concurrent-standby: held ready by the service first;
#                                # concurrent-detached: `pos restore` with no service, its
#                                # own process filling after it returned)
#   bench/device.sh multigpu     # (two GPUs) bench/multigpu_gpu.py: migrate --to-gpu with both
#                                # engines, a process on two GPUs, DDP over NCCL (POS_MULTI_GIB
#                                # of ballast, default 4; POS_MULTI_PARTS; POS_MULTI_DDP_CASES
#                                # POS_MULTI_DDP_ENGINES, POS_MULTI_DDP_GIB: bench/ddp.py's) (~8 min)
#   bench/device.sh torchrun     # (two GPUs, four for POS_TORCHRUN_RANKS=4; several counts,
#                                # POS_TORCHRUN_RANKS=8,4,2,1: each count's cases in turn) DDP
#                                # and FSDP2 as users start them: `pos run -- torchrun
#                                # --standalone ...`,
#                                # bench/torchrun_gpu.py's cases (POS_TORCHRUN_CASES, default
#                                # all: torchrun-sockets-concurrent, torchrun-defaults-concurrent,
#                                # torchrun-defaults-leave-running,
#                                # fsdp-torchrun-defaults-concurrent, stw-defaults), checkpointed
#                                # at a random step, the tree SIGKILLed and restored, every loss
#                                # against an uninterrupted run's (POS_TORCHRUN_GIB of ballast a
#                                # rank, default 2; POS_TORCHRUN_ARGS: more of its arguments,
#                                # e.g. "--repeat 3 --steps 200", or "--pos-env
#                                # default,POS_OWN_MEMORY_MAX_GIB=0": pos's settings in turn)
#                                # (~6 min at 2 ranks)
#   bench/device.sh tests        # the GPU tests that need CRIU and no bcc: tests/gpu's
#                                # checkpoint, concurrent, gpuhash and scale tests (~6 min)
#   bench/device.sh containers   # GPU jobs in podman containers: bench/containers_gpu.py, a
#                                # training job with pos's agent through CDI saved while it
#                                # runs, killed and restored exact, then its image restored as
#                                # POS_CONTAINERS_COPIES (default 2) containers at once
#                                # (POS_CONTAINERS_GIB of ballast, default 8; the bench stopped
#                                # after POS_CONTAINERS_LIMIT_S, default 450); podman, runc and
#                                # conmon from .device/podman (scripts/podman-setup.sh unpacks
#                                # them into /opt/pos-podman). Writes $OUT/containers/:
#                                # containers.json and raw/ (~4 min)
#
# Before the call, here: `bench/device.sh wheels` puts the wheels the machine's image lacks in
# .whl; ../shared/device/make-bundle.sh makes .device (bcc for trace/analyze/concurrent, CRIU for
# checkpoint/schedule: both together exceed the 64 MiB a call may carry, so drop the part a
# group does not need; bcc alone, 48 MiB, no longer fits beside the tree: carry its LLVM and z3
# packages in one call that copies them to /var/tmp/bccdebs, then the rest in the next call,
# which puts both into .device/bcc before `source .device/setup.sh`). For CRIU 4.2 (4.1
# cannot dump a process with a TCP/UDP socket on Linux >= 6.16): scripts/criu-debs.sh
# .device/criu. For containers (the GPU machine has no
# podman): scripts/podman-debs.sh .device/podman, beside .device/criu (no bcc: 7 + 18 MiB).
# Then carry .whl and .device. What a group leaves under $OUT comes back as one archive,
# $OUT/all.tgz (POS_BENCH_PACK=0: as loose files).
#
# The baseline in the same run, for a change: POS_BENCH_BASE=DIR runs the group first from
# another tree, a checkout of the commit to compare against (here: `mkdir .base && git archive
# COMMIT -- . ':!bench/results' | tar -x -C .base`, 3 MB, ignored, carried beside .device and
# .whl), into $OUT/base, recorded as POS_BENCH_BASE_COMMIT; then this tree's run, into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
group=${1:?say which group: wheels trace analyze checkpoint checkpoint32 tests concurrent restart pin exit anon attach perf export vmm tensormap drain criudest kdat schedule scale floor multigpu nccl torchrun serve containers}
if [ "$group" = wheels ]; then   # CPython 3.12 on the GPU machine
    exec python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --no-deps -d .whl \
        SQLAlchemy==2.0.44 greenlet pyelftools lz4 zstandard cxxfilt croniter pyroute2 protobuf \
        pyseccomp
fi
out=${OUT:?run this through the device tool: it sets OUT}
# POS_BENCH_TOUCH=1: bench/touch_host.py first (most of the free memory written once and freed,
# twice over: the first pass's rate against the next's), so that a freshly started machine's
# first tree does not meet memory never written since it started; into $OUT/touch*.json
if [ "${POS_BENCH_TOUCH:-0}" = 1 ]; then
    python3 bench/touch_host.py --out "$out/touch-1.json"
    python3 bench/touch_host.py --out "$out/touch-2.json"
fi
if [ -n "${POS_BENCH_BASE:-}" ]; then
    base=$(realpath "$POS_BENCH_BASE")
    ln -sfn "$PWD/.device" "$base/.device"
    ln -sfn "$PWD/.whl" "$base/.whl"
    mkdir -p "$out/base"
    (cd "$base" && OUT="$out/base" POS_BENCH_BASE='' POS_BENCH_TOUCH=0 POS_BENCH_PACK=0 \
        POS_BENCH_COMMIT="${POS_BENCH_BASE_COMMIT:-baseline}" bash bench/device.sh "$group")
fi

# shellcheck disable=SC1091
source .device/setup.sh
# each tree starts without the CRIU cache that pos keeps (pos/process/kdat.py), which a tree run
# before it on this machine would otherwise find; POS_BENCH_KDAT=keep leaves it
[ "${POS_BENCH_KDAT:-drop}" = keep ] || umount /run/criu.kdat /run/pos/kdat 2> /dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
# byte-compiled, as an installed pos and its dependencies are: a command's first import of a
# module is then not its compilation
python3 -m compileall -q -j 0 /tmp/site pos bench > /dev/null 2>&1 || true
export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
{ date -u +%FT%TZ; echo "${POS_BENCH_COMMIT:-$(git log -1 --format=%H 2>/dev/null)}"; nvidia-smi --query-gpu=name,driver_version \
    --format=csv,noheader; uname -r; ${POS_CRIU:-criu} --version 2>/dev/null | head -1; } \
    > "$out/machine.txt"

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, go on whatever it returns
    local name=$1; shift
    echo "== $name: $*" | tee -a "$out/steps.txt"
    local t0=$SECONDS
    "$@" > "$out/$name.log" 2>&1
    echo "   exit $? after $((SECONDS - t0)) s" | tee -a "$out/steps.txt"
    tail -5 "$out/$name.log"
}

case $group in
trace)
    [ "${POS_BENCH_TEST:-1}" = 0 ] ||   # POS_BENCH_TEST=0: the bench alone
        step trace-test python3 -m pytest -ra -s tests/gpu/test_trace_gpu.py
    # shellcheck disable=SC2086  # POS_TRACE_ONLY: a subset, as "--only count --only floor"
    step trace-bench python3 bench/trace_gpu.py --out "$out/trace-h100.json" \
        ${POS_TRACE_ONLY:---only count --only launch --only floor --only storm} \
        --launches 200000 --rounds 9 --storm-threads 8 --storm-seconds 2 ;;
analyze)
    step analyze-test python3 -m pytest -ra tests/gpu/test_analyzer_gpu.py
    step validate python3 bench/validate_gpu.py --out "$out/validate-gpu-h100.json" ;;
checkpoint)
    step checkpoint-test python3 -m pytest -ra -s tests/gpu/test_checkpoint_gpu.py
    step checkpoint-bench python3 bench/checkpoint_gpu.py --sizes 1,4,16 \
        --out "$out/checkpoint-h100.json" --images /tmp ;;
tests)
    step native python3 -m pos.native
    step gpu-tests python3 -m pytest -ra -s tests/gpu/test_checkpoint_gpu.py \
        tests/gpu/test_concurrent_gpu.py tests/gpu/test_gpuhash_gpu.py tests/gpu/test_scale_gpu.py
    tail -15 "$out/gpu-tests.log" ;;
checkpoint32)
    step checkpoint-bench-32 python3 bench/checkpoint_gpu.py --sizes 32 \
        --out "$out/checkpoint-h100-32.json" --images /tmp ;;
concurrent)
    step native python3 -m pos.native
    [ "${POS_BENCH_FILLCPU:-0}" = 0 ] ||   # the fill's CPU part alone, one pass against three
        step fill-cpu python3 bench/fill_cpu.py --gib 4 --threads 1,8,16 --out "$out/fill-cpu.json"
    # shellcheck disable=SC2086  # POS_BENCH_ARGS: more arguments for the bench, word-split
    step concurrent-bench python3 bench/concurrent_gpu.py --out "$out" \
        --only "${POS_BENCH_ONLY:-overhead,consistency,hoistfd,big,stw}" ${POS_BENCH_ARGS:-}
    [ "${POS_BENCH_TEST:-1}" = 0 ] ||   # POS_BENCH_TEST=0: the bench parts alone
        step concurrent-test python3 -m pytest -ra -s tests/gpu/test_concurrent_gpu.py ;;
pin)
    step pin python3 bench/pin_probe.py --out "$out" --gib "${POS_PIN_GIB:-16}"
    cat "$out/pin.log" ;;
hostcopy)
    step hostcopy python3 bench/hostcopy_probe.py --out "$out" --gib "${POS_HOSTCOPY_GIB:-16}" \
        --ways "${POS_HOSTCOPY_WAYS:-bounce,bounce-faulted,bounce-halves,pageable}"
    cat "$out/hostcopy.log" ;;
anon)
    export NCCL_NVLS_ENABLE=0
    step anon python3 bench/anon_probe.py --out "$out" --ranks "${POS_ANON_RANKS:-1}"
    cat "$out/anon.log" ;;
exit)
    step exit python3 bench/exit_probe.py --out "$out" --gib "${POS_EXIT_GIB:-16}" --repeat 3
    grep '^row' "$out/exit.log" ;;
drain)
    dest=${POS_DRAIN_DEST:-/dev/shm}
    for size in ${POS_DRAIN_HUGETLB//,/ }; do   # the image's GiB and one more, in such pages
        kib=2048; [ "$size" = 1G ] && kib=1048576
        pages=$(( (${POS_DRAIN_GIB:-16} + 1) * 1048576 / kib ))
        echo "$pages" > "/sys/kernel/mm/hugepages/hugepages-${kib}kB/nr_hugepages"
        grep . /sys/kernel/mm/hugepages/hugepages-${kib}kB/{nr,free}_hugepages >> "$out/hugetlb.txt"
        mkdir -p "/mnt/pos-hugetlb-$size"
        mount -t hugetlbfs -o "pagesize=$size" none "/mnt/pos-hugetlb-$size"
        dest=$dest,/mnt/pos-hugetlb-$size
    done
    step drain python3 bench/drain_probe.py --out "$out" --gib "${POS_DRAIN_GIB:-16}" \
        --dest "$dest" --threads "${POS_DRAIN_THREADS:-16,8}" --ways "${POS_DRAIN_WAYS:-}"
    for size in ${POS_DRAIN_HUGETLB//,/ }; do   # the reserved pages given back
        umount "/mnt/pos-hugetlb-$size"
        kib=2048; [ "$size" = 1G ] && kib=1048576
        echo 0 > "/sys/kernel/mm/hugepages/hugepages-${kib}kB/nr_hugepages"
    done
    grep '^row' "$out/drain.log" ;;
criudest)
    step criu-dest python3 bench/criu_dest_probe.py --out "$out"
    grep '^row' "$out/criu-dest.log" ;;
kdat)
    step kdat bash bench/kdat_probe.sh
    cat "$out/kdat.log" ;;
tensormap)
    step tensormap python3 bench/tensormap_probe.py --out "$out"
    cat "$out/tensormap.log" ;;
export)
    step export python3 bench/export_probe.py --out "$out"
    cat "$out/export.log" ;;
vmm)
    # shellcheck disable=SC2086  # POS_VMM_ARGS: more arguments for the probe, word-split
    step vmm python3 bench/vmm_probe.py --out "$out" ${POS_VMM_ARGS:-}
    cat "$out/vmm.log" ;;
attach)
    step attach python3 bench/attach_probe.py --out "$out" --ways "${POS_ATTACH_WAYS:-nvml-all,ctx-cold,ctx-one,ctx-held,nvml-beside,pos-again,pos-thread-one,pos-thread-all,pos-ctx-one,pos-ctx-all}"
    cat "$out/attach.log" ;;
perf)
    step native python3 -m pos.native
    (while sleep 2; do echo "$(date +%T) $(free -m | awk '/Mem:/ {print $2, $3, $7}')"; done) \
        > "$out/mem.log" 2>&1 &
    sampler=$!
    step perf python3 bench/perf_gpu.py --out "$out" \
        --cases "${POS_PERF_CASES:-0.3+pinall+nostw,0.3+nostw,0.3+shadow8+nostw}"
    kill "$sampler" 2>/dev/null
    grep '^row' "$out/perf.log" | cut -c1-900
    # where the command's start-up goes (to_start): its imports, once warm
    for i in 1 2; do
        python3 -X importtime -c 'import pos.cli, pos.concurrent.checkpoint' 2> "$out/importtime-$i.txt"
    done
    sort -t'|' -k2 -n "$out/importtime-2.txt" | tail -15
    # and what `pos restore` imports once the job runs, to record the restore (`record`)
    python3 -X importtime -c 'import pos.store.images' 2> "$out/importtime-store.txt"
    sort -t'|' -k2 -n "$out/importtime-store.txt" | tail -3
    { time python3 -m pos.cli --help > /dev/null; } 2>&1 | tail -3
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log ./*.err ./*.txt 2>/dev/null) ;;
restart)
    # shellcheck disable=SC2086  # POS_BENCH_ARGS: more arguments for the bench, word-split
    step restart-bench python3 bench/restart_gpu.py --out "$out" ${POS_BENCH_ARGS:-} ;;
scale)
    step native python3 -m pos.native
    (while sleep 2; do echo "$(date +%T) $(free -m | awk '/Mem:/ {print $2, $3, $7}')"; done) \
        > "$out/mem.log" 2>&1 &
    sampler=$!
    dmesg -w > "$out/dmesg.log" 2>&1 &
    kmsg=$!
    # shellcheck disable=SC2046
    step scale python3 bench/scale_gpu.py --out "$out" --rows "${POS_SCALE_ROWS-0.3,0.6,0.6@0.92,0.9}" \
        $([ "${POS_SCALE_STW:-1}" = 0 ] && echo --no-stw) \
        $([ -n "${POS_SCALE_FAULTS:-}" ] && echo --faults "$POS_SCALE_FAULTS")
    kill "$sampler" "$kmsg" 2>/dev/null
    grep '^row\|^machine\|^fault' "$out/scale.log"
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log ./*.err ./*.txt 2>/dev/null)
    [ "${POS_BENCH_TEST:-0}" = 0 ] ||
        step scale-test python3 -m pytest -ra -s tests/gpu/test_scale_gpu.py ;;
floor)
    step native python3 -m pos.native
    step floor python3 bench/floor_gpu.py --out "$out" --gib "${POS_FLOOR_GIB:-16,35}" \
        ${POS_FLOOR_NOSTW:+--no-stw}
    grep '^row' "$out/floor.log"
    cp /var/log/pos/*criu-restore.log "$out/" 2>/dev/null
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log ./*.err ./*.txt 2>/dev/null) ;;
multigpu)
    step native python3 -m pos.native
    step multigpu python3 bench/multigpu_gpu.py --out "$out" --gib "${POS_MULTI_GIB:-4}" \
        --parts "${POS_MULTI_PARTS:-ddp,split,migrate}" \
        --ddp-cases "${POS_MULTI_DDP_CASES:-direct-nolibuv,torchrun-nouring}" \
        --ddp-engines "${POS_MULTI_DDP_ENGINES:-stw,concurrent}" --ddp-gib "${POS_MULTI_DDP_GIB:-0}"
    grep '^\[{' "$out/multigpu.log"
    cp /var/log/pos/*criu*.log "$out/" 2>/dev/null
    for f in /tmp/pos-ddp/*/cr-*/job.log; do   # the ranks' standard error (the agents' lines)
        [ -f "$f" ] && cp "$f" "$out/$(basename "$(dirname "$(dirname "$f")")")-$(basename "$(dirname "$f")").log"
    done
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log ./*.txt ./ddp.json ./machine.json \
        2>/dev/null) ;;
nccl)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    step native python3 -m pos.native
    ddp() {  # ddp NAME NCCL_ENV RANKS ENGINES
        step "$1" python3 bench/ddp.py --python python3 --backend nccl --nccl-env "$2" \
            --ranks "$3" --engines "$4" --cases direct-nolibuv --steps 120 --at 20 \
            --ballast-gib "${POS_NCCL_GIB:-2}" --work "/tmp/pos-$1" --out "$out/$1.json"
        for f in /tmp/pos-"$1"/*/cr-*/job.log; do
            [ -f "$f" ] && cp "$f" "$out/$1-$(basename "$(dirname "$f")").log"
        done
    }
    for n in ${POS_NCCL_RANKS-2 4}; do
        ddp "ddp-defaults-$n" default "$n" "${POS_NCCL_DEFAULT_ENGINES:-stw,concurrent}"
    done
    for n in ${POS_NCCL_SOCKET_RANKS-4 1}; do ddp "ddp-sockets-$n" sockets "$n" concurrent; done
    cp /var/log/pos/*criu*.log "$out/" 2>/dev/null
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log ./*.txt 2>/dev/null) ;;
torchrun)
    step native python3 -m pos.native
    python3 -c 'import pyseccomp' ||
        echo "torchrun: pyseccomp is missing: run bench/device.sh wheels here and carry .whl" >&2
    # shellcheck disable=SC2086  # POS_TORCHRUN_ARGS: more arguments for the bench, word-split
    step torchrun python3 bench/torchrun_gpu.py --out "$out" --python python3 \
        --ranks "${POS_TORCHRUN_RANKS:-2}" --ballast-gib "${POS_TORCHRUN_GIB:-2}" \
        --cases "${POS_TORCHRUN_CASES:-torchrun-sockets-concurrent,torchrun-defaults-concurrent,torchrun-defaults-leave-running,fsdp-torchrun-defaults-concurrent,stw-defaults}" \
        ${POS_TORCHRUN_ARGS:-}
    grep '^row' "$out/torchrun.log"
    cp /var/log/pos/*criu*.log "$out/" 2>/dev/null
    # torchrun's and the ranks' output, the agents', by rank count (r2/CASE/job.log: r2-CASE.log)
    for f in /tmp/pos-torchrun/r*/*/job.log; do
        d=$(dirname "$f")
        [ -f "$f" ] && cp "$f" "$out/$(basename "$(dirname "$d")")-$(basename "$d").log"
    done
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log ./*.txt 2>/dev/null) ;;
serve)
    step native python3 -m pos.native
    step serve python3 bench/serve_gpu.py --out "$out" \
        --models "${POS_SERVE_MODELS:-gpt2-large,llama-7b}" \
        --cases "${POS_SERVE_CASES:-stw,concurrent,concurrent-lazy,concurrent-service,clone}" \
        --clones "${POS_SERVE_CLONES:-0}" --service-env "${POS_SERVE_SERVICE_ENV:-}" \
        --cold "${POS_SERVE_COLD:-dropped,warm}"
    grep '^row' "$out/serve.log"
    cp /var/log/pos/*criu-restore.log "$out/" 2>/dev/null
    (cd "$out" && tar czf raw.tgz --remove-files ./*.log 2>/dev/null) ;;
schedule)
    step schedule python3 bench/schedule_gpu.py --minutes 5 --out "$out/schedule-h100.json" ;;
containers)
    mkdir -p "$out/containers/raw"
    step native python3 -m pos.native
    step podman-setup scripts/podman-setup.sh .device/podman /opt/pos-podman \
        "${POS_CRIU:-/opt/pos-criu/criu}"   # .device/setup.sh's CRIU (.device/criu)
    export PATH=/opt/pos-podman/bin:$PATH
    # stopped (SIGINT) after POS_CONTAINERS_LIMIT_S: its rows so far and the case it was in
    step containers timeout -s INT "${POS_CONTAINERS_LIMIT_S:-450}" python3 \
        bench/containers_gpu.py --out "$out/containers" --python python3 \
        --copies "${POS_CONTAINERS_COPIES:-2}" --ballast-gib "${POS_CONTAINERS_GIB:-8}"
    grep '^row' "$out/containers.log"
    cp /var/log/pos/*criu*.log "$out/containers/raw/" 2>/dev/null
    mv "$out"/*.log "$out/steps.txt" "$out/machine.txt" "$out/containers/raw/" ;;
*)
    echo "unknown group $group: trace analyze checkpoint checkpoint32 concurrent restart pin perf schedule scale floor multigpu nccl torchrun serve containers" >&2
    exit 2 ;;
esac
# everything under $OUT (the baseline's too) as one archive, $OUT/all.tgz: only so many files
# come back from a call, and those past the limit are lost (POS_BENCH_PACK=0: left as they are)
if [ "${POS_BENCH_PACK:-1}" = 1 ]; then
    tar czf /tmp/pos-bench-all.tgz -C "$out" . && find "$out" -mindepth 1 -delete &&
        mv /tmp/pos-bench-all.tgz "$out/all.tgz"
fi
