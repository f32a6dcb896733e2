#!/bin/bash
# bench/cuda_check.sh: the device check of the cuda backend (chapter "The CUDA kernels", src/cuda.nw), on a
# machine with one NVIDIA GPU, in under 8 minutes: build a copy of the tree with --enable-cuda and run the
# CUDA tests there (they must run, not skip), train the default run on the GPU, and time the training step
# of the GPT-2-124M shape at B 8, T 1024 and at B 4, T 64 against PyTorch on the same GPU (float32 without
# TF32, eager and torch.compile), with the fraction of the cuBLAS sgemm rate measured in the same run.
#   bench/cuda_check.sh                  the whole check; logs and results in $CUDA_CHECK_OUT (./cuda-check)
#   bench/cuda_check.sh --table FILE     the table of a results file (the key=value lines the check wrote)
# Without a GPU it stops at once, with status 1 and the reason.  Exit status: 0 passed, 1 failed (the
# message names the stage and its log), 2 bad usage.  Environment: CUDA_CHECK_OUT, PYTHON (python3),
# CUDA_CONFIGURE (more configure arguments, as build-aux/check-cuda takes them).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
out=${CUDA_CHECK_OUT:-$PWD/cuda-check}
PYTHON=${PYTHON:-python3}
shapes="8:1024 4:64"

usage() {
  if [ "${1:-2}" -eq 0 ]; then sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi
  echo "usage: bench/cuda_check.sh [--table FILE] (--help says more)" >&2
  exit 2
}
die() { echo "cuda_check: $*" >&2; exit 1; }
stage() { echo "== $(date +%H:%M:%S) $*"; }

# The table: one row per shape, from the lines impl=normref-cuda, impl=cublas-sgemm, impl=torch-eager and
# impl=torch-compile of the results file; PyTorch's time over normref's (above 1: normref is faster), and
# normref's rate (bench_perf's FLOP count) over cuBLAS's rate on the step's own products.
table() {
  awk '
    function val(key,   i, kv) {
      for (i = 1; i <= NF; i++) { split($i, kv, "="); if (kv[1] == key) return kv[2] }
      return ""
    }
    function num(x) { return x == "" ? "-" : x }
    function ratio(a, b) { return (a == "" || b == "" || b + 0 == 0) ? "-" : sprintf("%.2f", a / b) }
    /^impl=/ {
      s = "B=" val("B") " T=" val("T")
      if (!(s in seen)) { seen[s] = 1; order[++n] = s }
      impl = val("impl")
      if (impl == "normref-cuda") { step[s] = val("step_s"); rate[s] = val("gflops") }
      if (impl == "cublas-sgemm") sgemm[s] = val("sgemm_gflops")
      if (impl == "torch-eager") eager[s] = val("step_s")
      if (impl == "torch-compile") comp[s] = val("step_s")
    }
    END {
      printf "%-12s %12s %12s %14s %14s %16s %14s %14s %9s\n", "shape", "normref s", "torch eager",
             "torch compile", "eager/normref", "compile/normref", "normref GF/s", "sgemm GF/s",
             "of sgemm"
      for (i = 1; i <= n; i++) {
        s = order[i]
        printf "%-12s %12s %12s %14s %14s %16s %14s %14s %9s\n", s, num(step[s]), num(eager[s]),
               num(comp[s]), ratio(eager[s], step[s]), ratio(comp[s], step[s]), num(rate[s]),
               num(sgemm[s]), ratio(rate[s], sgemm[s])
      }
    }' "$1"
}

case $# in
  0) ;;
  1) case $1 in -h|--help) usage 0 ;; *) usage ;; esac ;;
  2) [ "$1" = --table ] || usage
     [ -r "$2" ] || die "--table: cannot read $2"
     table "$2"; exit 0 ;;
  *) usage ;;
esac

# 1. A GPU, before anything is built.
command -v nvidia-smi > /dev/null 2>&1 ||
  die "no GPU: nvidia-smi is not installed (the check needs an NVIDIA GPU and its driver)"
gpus=$(nvidia-smi -L 2>&1) || die "no GPU: nvidia-smi -L failed: $gpus"
printf '%s\n' "$gpus" | grep -q '^GPU ' || die "no GPU: nvidia-smi lists none"
mkdir -p "$out" || die "cannot make $out"
results=$out/results.txt
: > "$results"
t0=$(date +%s)
echo "cuda_check: $(printf '%s\n' "$gpus" | head -1); results in $out"

# 2. The build and the CUDA tests, which must run here, not skip.
stage "build with --enable-cuda and run the CUDA tests"
tree=$out/tree
b=$tree/build
tests='tests/test_cuda tests/test_cuda_tool.sh tests/test_fast_cuda.sh tests/test_fast_model_cuda.sh'
CUDA_DIR=$tree CUDA_JOBS=$(nproc 2> /dev/null || echo 4) timeout 330 "$top/build-aux/check-cuda" \
  TESTS="$tests" check_PROGRAMS='tests/test_cuda tests/test_fast tests/test_fast_model' \
  > "$out/build.log" 2>&1 ||
  { tail -40 "$out/build.log"; die "the CUDA build or its tests failed (log: $out/build.log)"; }
grep -E '^(PASS|FAIL|SKIP|ERROR|XFAIL|XPASS)' "$out/build.log" | sed 's/^/  /' | tail -60
for t in test_cuda test_fast_cuda test_fast_model_cuda; do
  log=$b/tests/$t.log
  [ -f "$log" ] || [ -f "$b/tests/$t.sh.log" ] || die "no log of tests/$t in $b/tests"
  [ -f "$log" ] || log=$b/tests/$t.sh.log
  if grep -q '^1\.\.0 # SKIP' "$log"; then
    die "tests/$t skipped on a machine with a GPU: $(grep '^1\.\.0' "$log")"
  fi
done

# 3. The default run of normref train, on the GPU.
stage "train the default run on --device cuda"
ts=$(date +%s)
timeout 240 "$b/src/normref" train --device cuda --no-plots --force --out "$out/run" \
  > "$out/train.log" 2>&1 ||
  { tail -20 "$out/train.log"; die "train --device cuda failed (log: $out/train.log)"; }
grep -E 'finished|val_loss|loss' "$out/train.log" | tail -3 | sed 's/^/  /'
echo "  ($(( $(date +%s) - ts )) s)"

# 4. The step against PyTorch and against cuBLAS's sgemm, per shape.
stage "time the 124M step on normref's cuda backend, cuBLAS's sgemm and PyTorch"
make -C "$b" bench/bench_cuda > "$out/bench-build.log" 2>&1 ||
  { tail -20 "$out/bench-build.log"; die "bench/bench_cuda did not build (log: $out/bench-build.log)"; }
for shape in $shapes; do
  B=${shape%:*}
  T=${shape#*:}
  timeout 120 "$b/bench/bench_cuda" sgemm "B=$B" "T=$T" >> "$results" 2>> "$out/bench.log" ||
    die "bench_cuda sgemm B=$B T=$T failed (log: $out/bench.log)"
  timeout 180 "$b/bench/bench_cuda" step "B=$B" "T=$T" steps=10 >> "$results" 2>> "$out/bench.log" ||
    die "bench_cuda step B=$B T=$T failed (log: $out/bench.log)"
  for mode in eager compile; do
    PYTHONUNBUFFERED=1 timeout 240 "$PYTHON" "$top/bench/torch_cuda_bench.py" --mode "$mode" \
      --batch "$B" --seq "$T" --steps 10 >> "$results" 2>> "$out/torch.log"
    rc=$?
    [ "$rc" -eq 0 ] || echo "# torch-$mode B=$B T=$T: not timed (status $rc, see $out/torch.log)" |
      tee -a "$results"
  done
  grep "B=$B T=$T" "$results" | sed 's/^/  /'
done

stage "results"
table "$results" | tee "$out/table.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader 2> /dev/null |
  sed 's/^/# gpu: /'
echo "cuda_check: passed in $(( $(date +%s) - t0 )) s"
