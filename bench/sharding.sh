#!/usr/bin/env bash
# Per-rank memory of ddp vs fsdp ZeRO-1, 2 and 3 at 2 and 3 ranks (AdamW, fp32), against
# DeepSpeed's formulas (Ψ parameters, N ranks): ddp 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N,
# ZeRO-3 16Ψ/N bytes of
# parameters + gradients + optimizer state (fsdp's shards of the parameters, which the optimizer
# steps, count with the optimizer: they are DeepSpeed's fp32 master copy). Also peak RSS per rank
# and the median step time (Gloo's reduce-scatter on CPU is an emulation: reported, not tuned).
# Process memory two ways: the bytes malloc has handed out and not taken back at the end (allocator
# statistics: follows the tensors held) and the peak resident set (getrusage; also what the process
# held before the first step: libtorch, the model as built on every rank, the broadcast). The C heap
# keeps freed memory resident, so the peak RSS records the largest transient, not the steady state.
#   bench/sharding.sh [--width 768] [--layers 10] [--steps 4] [--batch 8]    (~47 M parameters)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
args=()
while (($#)); do
  case "$1" in
    --width | --layers | --steps | --batch) args+=("$1" "$2"); shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
"$here/../scripts/build.sh" --target bench_sharding -- -j"${FULGUR_JOBS:-2}" >/dev/null
export FULGUR_LOG_LEVEL=warn OMP_NUM_THREADS=1
unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT
results=$(mktemp)
for procs in 2 3; do
  for strategy in ddp fsdp:1 fsdp:2 fsdp:3; do
    "$FULGUR_BUILD_DIR/bin/bench_sharding" --strategy "$strategy" --procs "$procs" "${args[@]}" | grep RESULT >>"$results"
  done
done
"${FULGUR_VENV}/bin/python" - "$results" <<'PY'
import re, sys
rows = [dict(kv.split("=") for kv in re.findall(r"\w+=[\w.:]+", line)) for line in open(sys.argv[1])]
mb = lambda b: b / 2**20
print("| strategy | ranks | Ψ (M) | params+grads+optimizer per rank, MiB (max over ranks) | formula MiB | ratio | vs ddp "
      "| malloc in use at end MiB (max) | peak RSS MiB (max) | of which before step 1 | ms/step (rank 0) |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
ddp = {}
for strategy in ("ddp", "fsdp:1", "fsdp:2", "fsdp:3"):
    for procs in ("2", "3"):
        rs = [r for r in rows if r["strategy"] == strategy and r["procs"] == procs]
        if not rs:
            continue
        psi, n = int(rs[0]["numel"]), int(procs)
        held = max(int(r["parameters"]) + int(r["shard_parameters"]) + int(r["gradients"]) + int(r["optimizer"]) for r in rs)
        formula = {"ddp": 16 * psi, "fsdp:1": 8 * psi + 8 * psi / n, "fsdp:2": 4 * psi + 12 * psi / n,
                   "fsdp:3": 16 * psi / n}[strategy]
        if strategy == "ddp":
            ddp[procs] = held
        rss = max(int(r["peak_rss"]) for r in rs)
        before = max(int(r["peak_rss_before_training"]) for r in rs)
        in_use = max(int(r["malloc_in_use"]) for r in rs)
        step = float([r for r in rs if r["rank"] == "0"][0]["step_ms"])
        print(f"| {strategy} | {n} | {psi / 1e6:.1f} | {mb(held):.0f} | {mb(formula):.0f} | {held / formula:.3f} | "
              f"{held / ddp[procs]:.2f} | {mb(in_use):.0f} | {mb(rss):.0f} | {mb(before):.0f} | {step:.0f} |")
PY
rm -f "$results"
