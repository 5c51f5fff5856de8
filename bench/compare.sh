#!/usr/bin/env bash
# Fulgur side by side with a hand-written LibTorch loop, a plain PyTorch loop and PyTorch Lightning
# (pinned in scripts/requirements.txt) on an MLP, the example CNN and a small GPT, with the same
# data, initial weights and optimizer; prints markdown tables of ratios (bench/python/compare.py).
#
#   bench/compare.sh                         CPU, 5 interleaved runs per case and side
#   bench/compare.sh --threads 1             one intra-op thread everywhere (steadier on a busy machine)
#   bench/compare.sh --device cuda           on a GPU (Fulgur's sides need a 'cuda' accelerator plugin)
#   bench/compare.sh --quick --runs 1        smoke test (seconds)
#   bench/compare.sh --cases gpt:256:200:20  other model:batch:steps:warmup
#
# Builds bench_compare (and the plugins its Trainer loads) in $FULGUR_BUILD_DIR (default build/);
# FULGUR_JOBS caps the build's parallelism (default 2). Other arguments go to compare.py (--help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" --target bench_compare -- -j"${FULGUR_JOBS:-2}"
exec "$FULGUR_VENV/bin/python" "$here/python/compare.py" --bench-compare "$FULGUR_BUILD_DIR/bin/bench_compare" "$@"
