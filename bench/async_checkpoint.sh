#!/usr/bin/env bash
# [trainer] async_checkpoint: the wall time of `fulgur fit` on the GPT example (a wider model than
# examples/gpt/gpt.toml, so that a checkpoint weighs tens of MB) checkpointing every N steps,
# synchronous vs asynchronous, interleaved (sync, async, sync, async, ...) so that both sides see
# the same machine load. Prints each pair, the ratio async/sync as median [min, max], and the time
# the training thread spent inside the saves (the simple profiler's save_checkpoint total: the
# whole write when synchronous, the host copy when asynchronous), which load noise disturbs less.
#
#   bench/async_checkpoint.sh                    5 pairs, 30 steps, a checkpoint every 3 steps
#   bench/async_checkpoint.sh 3 40 4             pairs, steps, steps between checkpoints
#   N_EMBD=384 N_LAYER=6 BATCH=16 bench/async_checkpoint.sh   a bigger model or batch (default
#                                                256 x 4, batch 8 x 64 tokens: ~3.3 M parameters,
#                                                ~40 MB per checkpoint with AdamW)
#   CKPT_DIR=s3://bucket/bench bench/async_checkpoint.sh   checkpoints to object storage (AWS_*)
#   STRATEGY=ddp bench/async_checkpoint.sh      2 processes (DEVICES=N for another count): rank 0
#                                                writes in the background (AsyncSaveStrategy)
#   STRATEGY=fsdp STATE_DICT_TYPE=sharded bench/async_checkpoint.sh   every rank writes its shard
#                                                in the background (STATE_DICT_TYPE=full: rank 0)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" -- -j"${FULGUR_JOBS:-2}" >/dev/null
pairs="${1:-5}"
steps="${2:-30}"
every="${3:-3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
ckpt_dir="${CKPT_DIR:-$work/ckpt}"
# Several processes when STRATEGY names a multi-process strategy (ddp, fsdp); the simple profiler's
# figures are then rank 0's.
processes=""
strategy_table=""
if [[ -n "${STRATEGY:-}" ]]; then
  processes="strategy = \"$STRATEGY\"
devices = ${DEVICES:-2}"
  [[ -n "${STATE_DICT_TYPE:-}" ]] && strategy_table="[strategy]
state_dict_type = \"$STATE_DICT_TYPE\""
fi

write_toml() {  # write_toml FILE ASYNC RUN
  cat >"$1" <<TOML
[trainer]
max_steps = $steps
max_epochs = -1
limit_val_batches = 0
num_sanity_val_steps = 0
seed = 42
logger = false
enable_progress_bar = false
enable_model_summary = false
default_root_dir = "$work/root"
async_checkpoint = $2
$processes

[model]
name = "gpt"
block_size = 64
n_layer = ${N_LAYER:-4}
n_head = 4
n_embd = ${N_EMBD:-256}
lr = 3e-3
warmup_steps = 5
lr_decay_steps = $steps

[data]
name = "char_corpus"
corpus = "/usr/share/games/fortunes"
block_size = 64
batch_size = ${BATCH:-8}
num_workers = 1
seed = 42

[profiler]
name = "simple"

$strategy_table

[[callbacks]]
name = "model_checkpoint"
dirpath = "$ckpt_dir/$3"
every_n_train_steps = $every
save_top_k = 1
TOML
}

run() {  # run ASYNC RUN: prints the wall seconds of one fulgur fit
  write_toml "$work/$2.toml" "$1" "$2"
  local start end
  start=$(date +%s.%N)
  "$FULGUR_BUILD_DIR/bin/fulgur" fit --config "$work/$2.toml" >"$work/$2.log" 2>&1 ||
    { cat "$work/$2.log" >&2; exit 1; }
  end=$(date +%s.%N)
  echo "$end - $start" | bc -l
}

stalled() {  # stalled RUN: the simple profiler's save_checkpoint total (s) in RUN's output
  awk -F'|' '$2 ~ /^ *save_checkpoint *$/ { print $5 + 0; found = 1 } END { if (!found) print "nan" }' "$work/$1.log"
}

run false warmup >/dev/null  # token cache, page cache
echo "| pair | sync (s) | async (s) | async/sync | in saves, sync (s) | in saves, async (s) |"
echo "|---|---|---|---|---|---|"
ratios=()
for i in $(seq 1 "$pairs"); do
  s=$(run false "sync$i")
  a=$(run true "async$i")
  r=$(echo "$a / $s" | bc -l)
  ratios+=("$r")
  printf "| %d | %.2f | %.2f | %.3f | %.3f | %.3f |\n" "$i" "$s" "$a" "$r" "$(stalled "sync$i")" "$(stalled "async$i")"
done
label=""
[[ -n "${STRATEGY:-}" ]] && label=", $STRATEGY on ${DEVICES:-2} processes${STATE_DICT_TYPE:+ ($STATE_DICT_TYPE)}"
printf '%s\n' "${ratios[@]}" | sort -g | awk -v steps="$steps" -v every="$every" -v label="$label" '
  { r[NR] = $1 }
  END {
    median = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
    printf "\nasync/sync wall time, %d steps, a checkpoint every %d%s: median %.3f [%.3f, %.3f] over %d pairs\n",
           steps, every, label, median, r[1], r[NR], NR
  }'
