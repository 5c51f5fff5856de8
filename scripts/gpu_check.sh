#!/usr/bin/env bash
# The GPU check of the `cuda` accelerator (issue #12), for a machine with an NVIDIA GPU. Not run in
# CI. One command:
#
#   scripts/gpu_check.sh RESULTS_DIR
#   scripts/gpu_check.sh --prebuilt BUNDLE_DIR RESULTS_DIR
#
# The second form is for a GPU machine that can install nothing (no network): it runs what
# scripts/gpu_bundle.sh packed on a build machine (programs, plugins, libraries, data) against that
# machine's own python3 and torch, and neither installs nor builds. The first form:
#
# installs what is missing (scripts/setup.sh), builds, first trains the Fashion-MNIST example from
# TOML with `fulgur fit`, seeded, on cuda (the run must end with ATen's real CUDA hooks: a seed or a
# device query before the accelerator loads would have turned CUDA off), runs the GPU tests
# (doctest suite "gpu", CTest names "gpu: ...") and the cuda accelerator tests (any skipped test
# fails the check), trains the Fashion-MNIST example on cuda
# with 32-true and bf16-mixed (5 epochs each; test accuracy from the program's own output), trains
# a wider GPT for 200 steps under bf16-mixed and fp8 (tensorwise, rowwise: loss and step time), runs
# bench/compare.sh --device cuda on small cases and bench/cuda_graphs.sh (captured steps on and
# off, MFU in bf16), writes every log into RESULTS_DIR and prints one
# markdown summary (also RESULTS_DIR/summary.md). Exits non-zero, saying why, without a visible GPU.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bundle=""
if [ "${1:-}" = "--prebuilt" ] && [ $# -ge 2 ]; then
  bundle="$(cd "$2" && pwd)"
  shift 2
fi
if [ $# -ne 1 ]; then
  echo "usage: scripts/gpu_check.sh [--prebuilt BUNDLE_DIR] RESULTS_DIR" >&2
  exit 2
fi
mkdir -p "$1"
out="$(cd "$1" && pwd)"
source "$here/env.sh"
cd "$here/.."
jobs="${FULGUR_JOBS:-$(nproc)}"

# 1. A GPU, before spending time on anything else.
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >"$out/nvidia-smi.txt" 2>&1 ||
  ! grep -q '^GPU ' "$out/nvidia-smi.txt"; then
  echo "gpu_check: no NVIDIA GPU is visible on this machine (nvidia-smi -L: $(head -1 "$out/nvidia-smi.txt" 2>/dev/null || echo 'not installed')); run this on a GPU machine" >&2
  exit 1
fi
# --prebuilt (scripts/gpu_bundle.sh made BUNDLE_DIR on a build machine): nothing is installed or
# built here. The programs look for their build folder, the venv's torch and the sources at the
# absolute paths they were built with: those paths are made here, the torch ones pointing at this
# machine's python3 and its torch (the same release, checked), the sources at this checkout.
if [ -n "$bundle" ]; then
  # The interpreter itself (python3 on PATH may be a link outside its venv).
  py="$(python3 -c 'import sys; print(sys.executable)' 2>/dev/null || echo /opt/torch/.venv/bin/python3)"
  want="$(cat "$bundle/torch_version")"
  have="$("$py" -c 'import torch; print(torch.__version__)')"
  if [ "$want" != "$have" ]; then
    echo "gpu_check: the bundle was built against torch $want, but python3 here has torch $have" >&2
    exit 1
  fi
  build_dir="$(cat "$bundle/build_dir")"
  venv_dir="$(cat "$bundle/venv_dir")"
  site_dir="$(cat "$bundle/site_dir")"
  src_dir="$(dirname "$build_dir")"
  if [ "$src_dir" != "$PWD" ]; then
    mkdir -p "$src_dir"
    for entry in "$PWD"/* "$PWD"/.ci; do
      [ "$(basename "$entry")" = build ] || ln -sfn "$entry" "$src_dir/$(basename "$entry")"
    done
  fi
  mkdir -p "$build_dir/syslibs" "$(dirname "$site_dir")" "$venv_dir/bin" /usr/share/datasets/fashion-mnist
  # Python's tarfile: the machine may have no xz program.
  untar() { "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], **({"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}))' "$1" "$2"; }
  untar "$bundle/build.tar.xz" "$build_dir"
  untar "$bundle/syslibs.tar.xz" "$build_dir/syslibs"
  ln -sfn "$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')" "$site_dir"
  # A wrapper, not a link: python3 must find its own venv (a link would make it look beside the link).
  printf '#!/bin/sh\nexec "%s" "$@"\n' "$py" >"$venv_dir/bin/python"
  chmod +x "$venv_dir/bin/python"
  cp -f "$bundle"/fashion-mnist/*.gz /usr/share/datasets/fashion-mnist/
  export LD_LIBRARY_PATH="$build_dir/syslibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export FULGUR_BUILD_DIR="$build_dir" FULGUR_VENV="$venv_dir"
  # Fail fast (one device run is all there is): every library the GPU side loads resolves.
  missing="$(ldd "$build_dir/lib/fulgur/plugins/libfulgur-accelerator-cuda.so" "$build_dir/lib/libfulgur_nccl.so" \
    "$build_dir/bin/bench_compare" "$build_dir/bin/fulgur_tests" 2>&1 | grep 'not found' | sort -u || true)"
  if [ -n "$missing" ]; then
    echo "gpu_check: libraries not found on this machine:" >&2
    echo "$missing" >&2
    exit 1
  fi
else
  "$here/setup.sh"
fi
build_abs="$(cd "$FULGUR_BUILD_DIR" 2>/dev/null && pwd || echo "$PWD/$FULGUR_BUILD_DIR")"
ctest_bin="$(command -v ctest || echo "$(dirname "$("$FULGUR_VENV/bin/python" -c 'import sys; print(sys.executable)')")/ctest")"
torch_cuda="$("$FULGUR_VENV/bin/python" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>"$out/torch-cuda.txt" || echo 0)"
if [ "${torch_cuda:-0}" -lt 1 ]; then
  echo "gpu_check: torch sees no CUDA device (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}; see $out/torch-cuda.txt); a CPU-only torch wheel or a driver mismatch" >&2
  exit 1
fi

status=0
# The figure a check's log holds, for its summary line (empty when it has none).
figure_of() {
  local log="$out/$1.log"
  [ -f "$log" ] || return 0
  case "$1" in
    seeded_example)
      echo "$(grep -o 'FULGUR_CUDA_HOOKS: [a-z]* ([^)]*)' "$log" | tail -1 | cut -d' ' -f2-); $(grep -o 'test/acc [0-9.]*' "$log" | tail -1)" ;;
    gpu_tests)
      grep -E '[0-9]+% tests passed' "$log" | tail -1 ;;
    fashion_mnist_*)
      echo "$(grep -o 'test accuracy: [0-9.]*%' "$log" | tail -1) $(grep -o 'wall_seconds [0-9.]*' "$log" | tail -1)" ;;
    bench_*)
      grep -o 'json: .*' "$log" | tail -1 ;;
    gpt_*)
      echo "$(grep -o 'final_train_loss [0-9.]*' "$log" | tail -1) $(grep -o 'wall_seconds_per_step [0-9.]*' "$log" | tail -1)" ;;
  esac
}
# One markdown summary, from the logs only (missing logs show as n/a).
write_summary() {
  (
    set +e +o pipefail
    {
      echo "## Fulgur GPU check ($(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || cat "${bundle:-/nonexistent}/commit" 2>/dev/null || echo '?'))"
      echo
      echo '```'
      cat "$out/nvidia-smi.txt"
      echo '```'
      echo
      echo "| check | result | figure |"
      echo "|---|---|---|"
      while IFS= read -r line; do
        name="${line%%: *}"
        echo "| $name | ${line#*: } | $(figure_of "$name") |"
      done <"$out/steps.txt"
      echo
      echo "| Fashion-MNIST on cuda (5 epochs) | test accuracy | wall time |"
      echo "|---|---|---|"
      for precision in 32-true bf16-mixed; do
        log="$out/fashion_mnist_$precision.log"
        acc="$(grep -o 'test accuracy: [0-9.]*%' "$log" 2>/dev/null | tail -1 | cut -d' ' -f3)"
        wall="$(grep -o 'wall_seconds [0-9.]*' "$log" 2>/dev/null | tail -1 | cut -d' ' -f2)"
        echo "| $precision | ${acc:-n/a} | ${wall:+${wall} s} |"
      done
      echo
      echo "### gpu tests"
      echo
      echo '```'
      grep -E 'tests passed|tests failed|Failed|\*\*\*' "$out/gpu_tests.log" 2>/dev/null | tail -15 || true
      echo '```'
      echo
      echo "### bench/compare.sh --device cuda"
      echo
      sed -n '/^torch /,$p' "$out/bench_compare.log" 2>/dev/null || echo "(no tables: see $out/bench_compare.log)"
      echo
      echo "### bench/cuda_graphs.sh (captured steps, MFU)"
      echo
      sed -n '/^device /,$p' "$out/bench_cuda_graphs.log" 2>/dev/null || echo "(no table: see $out/bench_cuda_graphs.log)"
    } >"$out/summary.md.new" 2>/dev/null
    mv "$out/summary.md.new" "$out/summary.md"
  )
}

step() {  # step NAME COMMAND...: runs it, logs to $out/NAME.log, records the exit code
  local name="$1"
  shift
  echo "gpu_check: $name ..." >&2
  if "$@" >"$out/$name.log" 2>&1; then
    echo "$name: ok" >>"$out/steps.txt"
  else
    echo "$name: FAILED (exit $?; $out/$name.log)" >>"$out/steps.txt"
    status=1
  fi
  write_summary
}
: >"$out/steps.txt"

# 2. Build everything, then the GPU tests and the cuda accelerator's own tests.
if [ -z "$bundle" ]; then
  step build "$here/build.sh" -- -j"$jobs"
  build_abs="$(cd "$FULGUR_BUILD_DIR" && pwd)"
fi
[ -f "$build_abs/lib/fulgur/plugins/libfulgur-accelerator-cuda.so" ] || {
  echo "build: FAILED (no libfulgur-accelerator-cuda.so: is the torch wheel a CUDA build?)" >>"$out/steps.txt"
  status=1
}
# First, a user's run: Fashion-MNIST from TOML through `fulgur fit`, seeded, on cuda, with the
# CUDA-hooks report preloaded (tests/fixtures/cuda_hooks_report.cpp): it must train and end with
# ATen's real CUDA hooks.
seeded_example() {
  local dir="$out/seeded_example" report
  mkdir -p "$dir"
  report="$(find "$build_abs" -name libfulgur_cuda_hooks_report.so | head -1)"
  [ -n "$report" ] || { echo "no libfulgur_cuda_hooks_report.so in $build_abs"; return 1; }
  sed -e 's/^accelerator = .*/accelerator = "cuda"\ndevices = 1/' -e 's/^max_epochs = .*/max_epochs = 1/' \
    -e "s|^default_root_dir = .*|default_root_dir = \"$dir/runs\"|" -e 's/^name = "fashion_mnist_cnn".*/name = "fashion_mnist_mlp"/' \
    examples/fashion_mnist/fashion_mnist.toml >"$dir/job.toml"
  (cd "$dir" && LD_PRELOAD="$report" "$build_abs/bin/fulgur" fit --config job.toml --trainer.limit_train_batches=200) || return 1
  (cd "$dir" && "$build_abs/bin/fulgur" test --config job.toml --ckpt_path=last --trainer.limit_test_batches=50 2>&1 |
    sed -n 's/.*test\/acc[^0-9]*\([0-9.]*\).*/test\/acc \1/p' | tail -1) || true
  find "$dir" -name '*.ckpt' -delete
}
step seeded_example seeded_example
grep -q 'FULGUR_CUDA_HOOKS: real' "$out/seeded_example.log" 2>/dev/null || {
  echo "seeded_example: FAILED (the run did not end with ATen's real CUDA hooks; see $out/seeded_example.log)" >>"$out/steps.txt"
  status=1
}

# A test that cannot run prints "FULGUR_TEST_SKIPPED: <why>" (kept in the log by -V) and CTest
# reports it as Skipped, yet exits 0: on the GPU machine any skipped test fails the check.
step gpu_tests "$ctest_bin" --test-dir "$build_abs" -R '^gpu: |cuda|nccl' -V --timeout 240 -j2
if grep -q 'FULGUR_TEST_SKIPPED:' "$out/gpu_tests.log" 2>/dev/null ||
  grep -qE '^[[:space:]]*[0-9]+ - .*\(Skipped\)$' "$out/gpu_tests.log" 2>/dev/null; then
  echo "gpu_tests: FAILED (a test skipped itself: $(grep -o 'FULGUR_TEST_SKIPPED: .*' "$out/gpu_tests.log" | sort -u | head -3 | tr '\n' ';'))" >>"$out/steps.txt"
  status=1
fi

# 3. Fashion-MNIST on cuda, 32-true and bf16-mixed, 5 epochs.
train() {  # train PRECISION
  local dir="$out/fashion_mnist_$1"
  mkdir -p "$dir"
  sed -e 's/^accelerator = .*/accelerator = "cuda"\ndevices = 1/' -e "s/^precision = .*/precision = \"$1\"/" \
    -e 's/^max_epochs = .*/max_epochs = 5/' -e "s|^default_root_dir = .*|default_root_dir = \"$dir/runs\"|" \
    -e 's/^num_workers = .*/num_workers = 4/' examples/fashion_mnist/fashion_mnist.toml >"$dir/job.toml"
  local start="$EPOCHREALTIME" status=0
  (cd "$dir" && "$build_abs/bin/fashion_mnist" --config job.toml) || status=$?
  awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "wall_seconds %.1f\n", b - a }'
  find "$dir" -name '*.ckpt' -delete  # 5 MB each: the results must travel back small
  return "$status"
}
for precision in 32-true bf16-mixed; do step "fashion_mnist_$precision" train "$precision"; done

# 3b. FP8 training (issue #38): 200 steps of a wider GPT (n_embd 512, 4 layers, context 256, batch
# 32: products large enough for FP8's tensor cores) under bf16-mixed, fp8 tensorwise and fp8
# rowwise, on a corpus the script writes. Each log ends with the final train/loss and the wall time
# per step; the summary puts them side by side (the loss gap and the step-time ratio on this GPU).
gpt_fp8() {  # gpt_fp8 PRECISION [SCALING]
  local dir="$out/gpt_${1}${2:+_$2}" status=0
  mkdir -p "$dir"
  "$bench_py" -c 'import random,sys
r = random.Random(1); w = "the cat sat on a mat and dog ran to fulgur trains small models with bytes of text".split()
open(sys.argv[1], "w").write(" ".join(r.choice(w) for _ in range(400000)))' "$dir/corpus.txt" || return 1
  local start="$EPOCHREALTIME"
  (cd "$dir" && "$build_abs/bin/fulgur" fit --config "$OLDPWD/examples/gpt/gpt.toml" --trainer.accelerator=cuda \
    --trainer.devices=1 --trainer.precision="$1" --trainer.max_steps=200 --trainer.val_check_interval=200 \
    --trainer.limit_val_batches=2 --trainer.log_every_n_steps=10 --trainer.default_root_dir="$dir/runs" \
    --model.n_embd=512 --model.n_layer=4 --model.n_head=8 --model.block_size=256 --model.lr_decay_steps=200 --model.warmup_steps=20 \
    --data.block_size=256 --data.corpus="$dir/corpus.txt" --data.cache_dir="$dir/cache" \
    ${2:+--precision.scaling=$2}) || status=$?
  awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "wall_seconds_per_step %.4f\n", (b - a) / 200 }'
  local csv
  csv="$(find "$dir/runs" -name metrics.csv | head -1)"
  [ -n "$csv" ] && awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == "train/loss") c = i; next }
    c && $c != "" { last = $c } END { printf "final_train_loss %s\n", last }' "$csv"
  find "$dir" -name '*.ckpt' -delete
  return "$status"
}
bench_py="$FULGUR_VENV/bin/python"
step gpt_bf16-mixed gpt_fp8 bf16-mixed
step gpt_fp8_tensorwise gpt_fp8 fp8 tensorwise
step gpt_fp8_rowwise gpt_fp8 fp8 rowwise

# 4. Captured steps (cuda_graphs) on the small GPT at batch 16, 32-true and bf16-mixed, with MFU:
# first, since a check cut short by its time limit loses what runs last. The benchmarks go through
# their Python drivers with the built bench_compare (their .sh wrappers would build first).
step bench_cuda_graphs "$bench_py" bench/python/cuda_graphs.py --bench-compare "$build_abs/bin/bench_compare" \
  --runs 3 --cases gpt:16:300:30 --timeout 120 --json "$out/bench_cuda_graphs.json"

# 5. Side-by-side throughput on small cases (the barebones sides left out for time).
step bench_compare "$bench_py" bench/python/compare.py --bench-compare "$build_abs/bin/bench_compare" --device cuda \
  --runs 2 --cases mlp:256:200:20,cnn:256:100:10,gpt:64:100:10 --sides raw,fulgur,plain,lightning --timeout 120 \
  --json "$out/bench_compare.json"

# 6. The summary (also rewritten after every step above, so a check cut short still has one).
write_summary
cat "$out/summary.md"
exit $status
