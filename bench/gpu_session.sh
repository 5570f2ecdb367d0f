#!/usr/bin/env bash
# What a session lent a GPU machine runs there, one step per `run` call (each under its 10-minute
# limit), every log and result under $OUT (the folder that comes back). Each step builds the native
# core first if this machine has not yet (about 11 s; a machine handed back and started again is bare).
#
# A session has 15 minutes of device time in all, starts and idle waits included: staging the wheels
# (below) takes 4 calls, so the rest is about one call. Make it `first`, with LIMIT (seconds) under
# what `status` says is left, less a minute: a call cut off by the budget brings nothing back.
#
#   bash bench/gpu_session.sh first        in one call, in this order, each part stopped in time for the next:
#                                          the GPU tests; where graphed and eager lookups part (diag_graphs.py,
#                                          max pooling); tier 0 = 10% over host memory and over the log store
#                                          (FBGEMM's UVM cache, ours zero-copy with CUDA graphs and without, with
#                                          copies, over SSD with prefetch, waiting and with the store in stream
#                                          order (ours-ssd10-os); their stacks, their profiles and each phase of
#                                          their steps timed unprofiled, the log store's writes among them);
#                                          zero-copy's write-back with 8 and 32 programs; the store's reads and
#                                          writes in stream order against waiting, alone (gpu_storeio.py);
#                                          zero-copy's moves over 1M and 10M host rows; zero-copy
#                                          with rows of 160 words, each on a 128-byte line (--row-alignment
#                                          128); the table whole in HBM (FBGEMM, ours with CUDA graphs and
#                                          without, torch ops),
#                                          and again with aligned rows; zero-copy with a move program a block of
#                                          rows (--move-shape 16x4x64x0, as before the twenty-fifth session);
#                                          zero-copy's moves by row width (128, 129, 160, and 129 of 160) and the
#                                          host rows' allocation (registered, as ours, or torch's pinned memory);
#                                          the update kernel by its number of programs and the draw by its chunks;
#                                          FBGEMM's, ours-hbm's and ours-host10-zc's kernels a step
#                                          (torch.profiler); a queued plan by the assign kernel's programs; the
#                                          whole table with ragged bags, and with ids on the device; the
#                                          collection bench
#
# and, where time is left, one of the parts alone:
#
#   bash bench/gpu_session.sh second       after `first`, in a second call: the GPU tests that failed in the
#                                          thirty-fourth session's first call, diag_graphs.py, and zero-copy's
#                                          write-back by its programs (2 and 1 a multiprocessor, 16 and 4 in all)
#   bash bench/gpu_session.sh tests        tests/test_gpu.py: the GPU tests (not the child below)
#   bash bench/gpu_session.sh interpreted  the CPU-tensor tests (marked interpreted) as a machine without a GPU
#                                          runs them: what test_gpu.py's child test runs (about 8 minutes)
#   bash bench/gpu_session.sh suite        every other test file (the CPU engine, on this machine)
#   bash bench/gpu_session.sh hbm          bench_gpu.py: the table whole in HBM, ours and the peers
#   bash bench/gpu_session.sh host         bench_gpu.py: tier 0 = 10% over host memory (copies, zero-copy,
#                                          each with and without prefetch) against FBGEMM's UVM cache
#   bash bench/gpu_session.sh ssd          bench_gpu.py: tier 0 = 10% over the log store, prefetch depth 2
#   bash bench/gpu_session.sh device-ids   bench_gpu.py with every system given its ids and offsets on the GPU
#   bash bench/gpu_session.sh profile      one run of ours and FBGEMM's under torch.profiler ($OUT/prof.tgz)
#   bash bench/gpu_session.sh collection   bench_collection.py --device cuda --quick
#   bash bench/gpu_session.sh kernels      gpu_kernels.py: the forward and backward kernels alone, by launch shape
#   bash bench/gpu_session.sh moves        gpu_kernels.py --moves: zero-copy's move kernel, by launch shape
#   bash bench/gpu_session.sh plan         gpu_kernels.py --plan: a queued plan, by the assign kernel's programs
#   bash bench/gpu_session.sh storeio      gpu_storeio.py: 20K rows read from the log store and 20K written, queued on
#                                          the stream (StreamIo) against waiting for the device first
#
# FBGEMM's GPU TBE (the peer) and rocksdict / lz4 (which tieredemb imports: no table is made without
# them) do not come with the machine. Stage them from here first (../shared/tools/stage_wheels.sh
# .wheels rocksdict lz4 fbgemm-gpu==1.6.0, then python bench/restage_lzma.py .wheels: 4 folders, not
# 10; then one `run` per .wheels/wK folder carrying it, w0 first: it holds rocksdict and lz4:
# mkdir -p /root/w && cp .wheels/wK/* /root/w/); the first step after that
# assembles them into /tmp/site (if a piece is missing, it installs the wheels that are whole, and
# the FBGEMM systems print "skipped"). What setup found is at the head of the log.
#
# Few files come back from a call (eight: the twenty-fifth session's `first` left eleven, and three
# did not come back): each step leaves a log, a JSON and at most one archive under $OUT; `first`
# leaves its log and one archive, first.tgz, of every part's JSON and of the profiles.
# A step that hangs is stopped before the call's limit (LIMIT seconds) with every thread's stack in
# its log (SIGABRT; SIGKILL 15 s later if that does not end it).
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:-}
case "$step" in
  first|second|tests|interpreted|suite|hbm|host|ssd|device-ids|profile|collection|kernels|moves|plan|storeio) ;;
  *) echo "usage: bash bench/gpu_session.sh first|second|tests|interpreted|suite|hbm|host|ssd|device-ids|profile|collection|kernels|moves|plan|storeio" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_session}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # (SIGABRT from `timeout -k 15 -s ABRT`: every thread's stack)
LIMIT=${LIMIT:-560}
mkdir -p "$OUT"

STOP=$LIMIT  # a part is stopped at min(its cap, STOP - the seconds since this script started)
LOG=  # where every log goes (first: one file, since few come back), else $OUT/NAME.log
JSONS=$OUT  # where each part's JSON goes (first: /tmp/json, archived into first.tgz at the end)
[ "$step" = first ] || [ "$step" = second ] && LOG=$OUT/first.log && JSONS=/tmp/json && rm -rf /tmp/json && mkdir -p /tmp/json
log() { tee ${LOG:+-a} "${LOG:-$OUT/$1.log}"; }
setup() {
  if [ -f /root/w/assemble.sh ] && [ ! -d /tmp/site ] && ! bash /root/w/assemble.sh /root/w /tmp/site; then
    # (a piece missing: the wheels whose checksums hold, alone; w0 holds rocksdict and lz4 whole)
    echo "gpu_session: the staged wheels did not all assemble: installing those that are whole"
    good=$(cd /root/w && { sha256sum -c SHA256SUMS 2>/dev/null || true; } | sed -n 's/: OK$//p' | sed 's|^|/root/w/|')
    [ -n "$good" ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $good || true
  fi
  if [ -d /tmp/site ]; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  if ! "$PY" -c 'import tieredemb._C' 2>/dev/null; then
    "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3
  fi
  "$PY" -c 'import rocksdict, lz4' 2>/dev/null || echo "gpu_session: rocksdict or lz4 is missing: no table can be made" \
    "(stage .wheels/w0 first: see above)"
  "$PY" -c 'import fbgemm_gpu' 2>/dev/null || echo "gpu_session: fbgemm_gpu does not import: FBGEMM's systems are skipped"
  for m in numba tqdm matplotlib libcachesim; do  # (declared dependencies: the suite's trace and planner tests)
    "$PY" -c "import $m" 2>/dev/null || echo "gpu_session: $m is not installed here"
  done
  "$PY" -c 'import sys, torch, triton, numpy; print("gpu_session: python", sys.version.split()[0], "torch",
    torch.__version__, "triton", triton.__version__, "numpy", numpy.__version__)' || true
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu,pcie.link.gen.current,pcie.link.width.current \
    --format=csv || true
  # (where the GPU sits against the CPUs and their memory: host rows on the far NUMA node cross the
  # link between sockets on their way over the bus; FBGEMM's UVM cache ran at 86-120 M lookups/s from
  # process to process on one H100 machine, 2026-11-27)
  nvidia-smi topo -m 2>/dev/null | head -4 || true
  lscpu 2>/dev/null | grep -i "numa" || true
}
setup 2>&1 | log setup
if [ -d /tmp/site ]; then
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

bench() {  # bench NAME ARGS...: bench_gpu.py with a log and a JSON under $OUT
  local name=$1; shift
  timeout -k 15 -s ABRT "$(budget "$LIMIT")" "$PY" bench/bench_gpu.py "$@" --json "$JSONS/$name.json" 2>&1 | log "$name"
}
kernels() {  # kernels NAME ARGS...: gpu_kernels.py (kernels alone, by launch shape) with a log and a JSON
  local name=$1; shift
  timeout -k 15 -s ABRT "$(budget "$LIMIT")" "$PY" bench/gpu_kernels.py "$@" --json "$JSONS/$name.json" 2>&1 | log "$name"
}
storeio() {  # gpu_storeio.py: the store's reads and writes queued on the stream against waiting, with a log and a JSON
  timeout -k 15 -s ABRT "$(budget "$LIMIT")" "$PY" bench/gpu_storeio.py --dir /tmp --json "$JSONS/storeio.json" \
    2>&1 | log storeio
}
collection() {  # bench_collection.py on the GPU, quick, with a log and a JSON
  timeout -k 15 -s ABRT "$(budget "$LIMIT")" "$PY" bench/bench_collection.py --device cuda --quick \
    --json "$JSONS/collection.json" 2>&1 | log collection
}
tests() {  # tests NAME ARGS...: pytest with a log under $OUT
  local name=$1; shift
  timeout -k 15 -s ABRT "$(budget "$LIMIT")" "$PY" -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | log "$name"
}
budget() {  # budget CAP: seconds the next part may take
  local left=$((STOP - SECONDS)); echo $(( left < $1 ? (left > 1 ? left : 1) : $1 ))
}
part() {  # part CAP COMMAND...: one part of `first`, its outcome in $OUT/first.log; the next runs anyway
  local cap=$1 rc=0; shift
  if [ $((STOP - SECONDS)) -lt 30 ]; then echo "first: no time left for: $*" | log first; return; fi
  local LIMIT; LIMIT=$(budget "$cap")
  echo "first: $* (cap $LIMIT s)" | log first
  "$@" || rc=$?
  echo "first: exit $rc after $SECONDS s" | log first
  # (archived after each part: a call cut short by its limit still brings back what was measured;
  # written beside, then renamed: a kill during the tar leaves the last whole archive)
  tar czf "$OUT/.first.tgz" -C /tmp json $([ -d /tmp/prof ] && echo prof) 2>/dev/null \
    && mv "$OUT/.first.tgz" "$OUT/first.tgz" || true
}
case "$step" in
  first)  # (what comes back: first.log and first.tgz: each part's JSON, and the hbm and cached systems' cProfiles
          # (the prefetch worker's by its thread's CPU time), the cached systems' stacks, three profiles;
          # bench_gpu.py interleaves the systems' runs, whose 20 batches take tens of milliseconds: many runs
          # cost little and steady the paired ratios; the cached systems warm up on 80 batches: tier 0 = 10 %
          # fills in about 50, and until then a miss evicts nothing (ours, 2026-11-27: 143K evictions in the
          # first 20-batch run after 20 warm-up batches, 430K a run once full)
    rm -rf /tmp/prof
    # (no table is made without rocksdict and lz4: every part would measure FBGEMM alone)
    "$PY" -c 'import rocksdict, lz4' 2>/dev/null || { echo "first: rocksdict or lz4 missing: stopped" \
      "(stage .wheels/w0, then call again)" | log first; exit 3; }
    # (a test that hangs: its stacks dumped after 60 s, and it is stopped at 90 s where pytest-timeout is there;
    # test_locks.py beside: its exit cases depend on the Python version, 3.12 there, 3.11 here; about 10 s)
    part 170 tests test_gpu -v --durations=15 -o faulthandler_timeout=60 tests/test_gpu.py tests/test_locks.py \
      $("$PY" -c 'import pytest_timeout' 2>/dev/null && echo --timeout=90) \
      --deselect tests/test_gpu.py::test_the_cpu_tensor_tests_pass_in_a_child
    # (first what decides the next changes: the cached systems, zero-copy's write-back mode, the store in stream
    # order; the new store path reported first, before the 10M-row tables' set-up can reach the cap; ours-host10
    # and ours-host10-zc-eager left out: measured at 0.25x and 0.40x)
    part 30 eval 'timeout -k 5 -s ABRT "$(budget 30)" "$PY" bench/diag_graphs.py max 2>&1 | log diag'
    part 200 bench cached --only fbgemm-uvm10,ours-ssd10-os,ours-ssd10,ours-host10-zc \
      --runs 7 --warmup 80 --ssd-path /tmp --stacks /tmp/prof --cprofile /tmp/prof --phases
    # (zero-copy's write-back by its programs, around the default of 16 in all (thirty-fourth session, an H200:
    # 264 90.3 M, 132 91.0, 16 95.7, 4 74.4); written down by the swap itself measured the same as 264 apart)
    part 45 bench writeback_8 --only fbgemm-uvm10,ours-host10-zc --runs 5 --warmup 80 --write-back-programs 8
    part 45 bench writeback_32 --only fbgemm-uvm10,ours-host10-zc --runs 5 --warmup 80 --write-back-programs 32
    part 60 storeio
    # (the swap read 22K misses in 536 us in a step, 274 us alone over 1M host rows: the table's 10M host rows?)
    part 50 kernels moves_reach --moves --reps 10 --move-widths 129 --move-host-rows 1000000,10000000 \
      --move-shapes 16x4x64x8
    part 80 bench cached_aligned --only fbgemm-uvm10,ours-host10-zc --runs 9 --warmup 80 --row-alignment 128
    part 90 bench hbm --only fbgemm-hbm,ours-hbm,ours-hbm-eager,torch-ops --runs 15 --cprofile /tmp/prof --phases
    part 60 bench hbm_aligned --only fbgemm-hbm,ours-hbm --runs 9 --row-alignment 128
    part 80 bench cached_a_block --only fbgemm-uvm10,ours-host10-zc --runs 9 --warmup 80 --move-shape 16x4x64x0
    part 70 kernels moves --moves --reps 10 --move-widths 128,129,160,129/160 --move-host-rows 1000000 \
      --move-alloc register,pinned --move-shapes 16x4x64x8
    part 60 kernels kernels --warps 1 --tiles 16 --update-programs 0,8,16,32,64 --reps 10
    part 50 bench profiled --only fbgemm-hbm,ours-hbm,ours-host10-zc --runs 1 --profile /tmp/prof
    part 45 kernels plan --plan --update-programs 0,8,16,32,64 --reps 10
    part 70 bench ragged --only fbgemm-hbm,ours-hbm,ours-hbm-eager --runs 9 --ragged
    part 70 bench device_ids --only fbgemm-hbm,ours-hbm,ours-hbm-eager --runs 9 --ids-on-device
    part 600 collection
    tar czf "$OUT/first.tgz" -C /tmp json $([ -d /tmp/prof ] && echo prof) || true ;;
  second)  # (a second call's probe, after `first`: the GPU tests that failed there and the weight decay's; where
           # graphed and eager lookups part for max pooling of fp16 rows rounded stochastically; zero-copy's
           # write-back by its programs (2 a multiprocessor, 1, 16 and 4 in all) against FBGEMM's UVM cache)
    rm -rf /tmp/prof
    "$PY" -c 'import rocksdict, lz4' 2>/dev/null || { echo "second: rocksdict or lz4 missing: stopped" | log first; exit 3; }
    part 60 tests test_gpu -v -o faulthandler_timeout=40 tests/test_gpu.py -k "weight_decay or fp16-stochastic or l2 or adamw"
    part 40 eval 'timeout -k 5 -s ABRT "$(budget 40)" "$PY" bench/diag_graphs.py max 2>&1 | log diag'
    for wb in 2x 1x 16 4; do
      part 40 bench "writeback_$wb" --only fbgemm-uvm10,ours-host10-zc --runs 5 --warmup 80 --write-back-programs $wb
    done
    tar czf "$OUT/first.tgz" -C /tmp json || true ;;
  tests) tests test_gpu tests/test_gpu.py --deselect tests/test_gpu.py::test_the_cpu_tensor_tests_pass_in_a_child ;;
  interpreted)
    par=$("$PY" -c 'import xdist; print("-n 8")' 2>/dev/null || true)
    CUDA_VISIBLE_DEVICES="" TRITON_INTERPRET=1 tests interpreted -m interpreted $par tests ;;
  suite) tests suite --ignore tests/test_gpu.py -m "not interpreted" tests ;;
  hbm) bench hbm --only fbgemm-hbm,ours-hbm,ours-hbm-eager,torch-ops,torch-sparse --profile /tmp/prof
    { [ -d /tmp/prof ] && tar czf "$OUT/prof.tgz" -C /tmp prof; } || true ;;
  host) bench host --only fbgemm-uvm10,ours-host10,ours-host10-zc,ours-host10-zc-eager,ours-host10-pf2,ours-host10-zc-pf2 ;;
  ssd) bench ssd --only fbgemm-uvm10,ours-ssd10,ours-ssd10-os --ssd-path /tmp ;;
  device-ids) bench device_ids --only fbgemm-hbm,ours-hbm,fbgemm-uvm10,ours-host10,ours-host10-pf2 --ids-on-device ;;
  profile)  # (the profiles packed into one archive: few files come back)
    rc=0
    rm -rf /tmp/prof
    bench profile --only fbgemm-hbm,ours-hbm,fbgemm-uvm10,ours-host10,ours-host10-zc --runs 1 --profile /tmp/prof || rc=$?
    [ -d /tmp/prof ] && tar czf "$OUT/prof.tgz" -C /tmp prof
    exit $rc ;;
  collection) collection ;;
  kernels) kernels kernels ;;
  moves) kernels moves --moves ;;
  plan) kernels plan --plan ;;
  storeio) storeio ;;
esac
