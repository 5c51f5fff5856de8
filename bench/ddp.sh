#!/usr/bin/env bash
# Data-parallel throughput on this machine: 2 ddp processes (1 intra-op thread each) vs 1 process
# with 1 thread (one "device") and vs 1 process with 2 threads (the whole machine), plus the
# all-reduce share of a step, how much of it overlaps backward, and what the per-batch signal
# agreement (one boolean all-reduce after every batch) costs next to a step. Runs are
# interleaved; medians.
#   bench/ddp.sh [--model mlp|conv|fashion_cnn|fashion_mlp] [--rounds 3] [--batch 128] [--steps 40] [--bucket-mb 25]
# mlp: 784-1024-1024-10, 7.6 MB of gradients per step (communication-heavy on loopback);
# conv: three 3x3 convolutions, 0.2 MB of gradients (compute-bound);
# fashion_cnn / fashion_mlp: the Fashion-MNIST example's nets (its TOML: the CNN, --batch 64).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
rounds=3 batch=128 steps=40 model=mlp bucket=25
while (($#)); do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --bucket-mb) bucket="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
"$here/../scripts/build.sh" --target bench_ddp -- -j"${FULGUR_JOBS:-2}" >/dev/null
bench() { "$FULGUR_BUILD_DIR/bin/bench_ddp" --model "$model" --bucket-mb "$bucket" "$@"; }
export FULGUR_LOG_LEVEL=warn
unset OMP_NUM_THREADS RANK WORLD_SIZE MASTER_ADDR MASTER_PORT
results=$(mktemp)
for ((r = 0; r < rounds; r++)); do
  bench --procs 1 --threads 1 --batch "$batch" --steps "$steps" | grep RESULT | sed 's/^/one_core /' >>"$results"
  bench --procs 1 --threads 2 --batch "$batch" --steps "$steps" | grep RESULT | sed 's/^/one_proc_two_threads /' >>"$results"
  bench --procs 2 --threads 1 --batch "$batch" --steps "$steps" | grep RESULT | sed 's/^/ddp /' >>"$results"
  bench --procs 2 --threads 1 --batch "$batch" --steps "$steps" --accumulate 100000 | grep RESULT |
    sed 's/^/ddp_nosync /' >>"$results"
done
"${FULGUR_VENV}/bin/python" - "$results" "$batch" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name = line.split()[0]
    vals = dict(kv.split("=") for kv in re.findall(r"\w+=[\d.]+", line))
    rows.setdefault(name, []).append(vals)
batch = int(sys.argv[2])
med = lambda name, key: statistics.median(float(v[key]) for v in rows[name])
t1, t1b, t2, t2n = (med(n, "batch_ms") for n in ("one_core", "one_proc_two_threads", "ddp", "ddp_nosync"))
ar = med("ddp", "allreduce_ms")
agree = [float(v[k]) for v in rows["ddp"] + rows["ddp_nosync"] for k in ("agree_us_min", "agree_us_max")]
agree_med = statistics.median(float(v["agree_us_median"]) for v in rows["ddp"] + rows["ddp_nosync"])
runs = len(rows["ddp"]) + len(rows["ddp_nosync"])
print(f"| layout | ms/step | samples/s | vs 1 proc, 1 thread |")
print(f"|---|---|---|---|")
for name, t, procs in (("1 process, 1 thread", t1, 1), ("1 process, 2 threads", t1b, 1), ("ddp, 2 processes x 1 thread", t2, 2)):
    sps = procs * batch / (t / 1000)
    print(f"| {name} | {t:.2f} | {sps:.0f} | {sps / (batch / (t1 / 1000)):.2f}x |")
exposed = max(0.0, t2 - t2n)
print()
print(f"- ddp vs 1 process with 2 threads: {(2 * batch / t2) / (batch / t1b):.2f}x")
print(f"- all-reduce of all gradients alone: {ar:.2f} ms; ddp step with sync {t2:.2f} ms, without (accumulation micro-step) {t2n:.2f} ms")
print(f"- exposed communication: {exposed:.2f} ms = {100 * exposed / t2:.1f}% of a step; "
      f"hidden behind backward: {100 * max(0.0, 1 - exposed / ar) if ar > 0 else 0:.0f}% of the all-reduce time")
print(f"- signal agreement (interrupt_due: one boolean all-reduce per batch): {agree_med:.0f} us per call "
      f"(median; min {min(agree):.0f}, max {max(agree):.0f} over {runs} runs x 20 repeats of 200 calls) = "
      f"{100 * agree_med / 1000 / t2:.2f}% of a {t2:.2f} ms ddp step")
PY
rm -f "$results"
