#!/usr/bin/env bash
# The share of the training epoch that the Fashion-MNIST example (real data, its own TOML) spends
# waiting for the next batch, at 0, 1 and 2 loader workers: the simple profiler's
# train_dataloader_next total over its run_training_epoch total (issue #15's target: < 5%).
#
#   bench/data_wait.sh            300 training batches per run
#   bench/data_wait.sh 100        fewer
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" -- -j"${FULGUR_JOBS:-2}" >/dev/null
batches="${1:-300}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "| workers | waited for data (s) | training epoch (s) | share |"
echo "|---|---|---|---|"
for workers in 0 1 2; do
  sed -e "s|^max_epochs = .*|max_epochs = 1\nlimit_train_batches = $batches\nlimit_val_batches = 10|" \
    -e "s|^default_root_dir = .*|default_root_dir = \"$work/run$workers\"|" \
    -e "s|^num_workers = .*|num_workers = $workers|" \
    examples/fashion_mnist/fashion_mnist.toml >"$work/run$workers.toml"
  "$FULGUR_BUILD_DIR/bin/fashion_mnist" --config "$work/run$workers.toml" >"$work/out$workers.txt" 2>&1
  # The simple profiler's table: | action | mean (s) | calls | total (s) | percent |
  awk -F'|' -v w="$workers" '
    $2 ~ /^ *train_dataloader_next *$/ { wait = $5 + 0 }
    $2 ~ /^ *run_training_epoch *$/ { epoch = $5 + 0 }
    END {
      if (epoch <= 0) { print "data_wait: no profiler table in the output" > "/dev/stderr"; exit 1 }
      printf "| %d | %.3f | %.3f | %.2f%% |\n", w, wait, epoch, 100 * wait / epoch
    }' "$work/out$workers.txt"
done
