#!/usr/bin/env bash
# Tensor parallelism per rank: parameter, gradient, AdamW-state and activation bytes and bytes sent
# per step of the GPT example under `model_parallel` at tp = 1, 2 and dp x tp = 2 x 2, with and
# without sequence parallelism, measured from `fulgur fit` (bench_step_probe) next to the formulas
# (bench/python/tensor_parallel.py). Prints a markdown table (~1 min on 2 cores).
#
#   bench/tensor_parallel.sh                     the defaults: n_layer 2, n_embd 64, block_size 64
#   bench/tensor_parallel.sh --n-embd 128 --steps 10
#
# Builds `fulgur`, the GPT plugins, model_parallel and bench_step_probe in $FULGUR_BUILD_DIR
# (default build/); FULGUR_JOBS caps the build's parallelism (default 2). The corpus is 256 KiB of
# generated text unless --corpus names one.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" --target fulgur fulgur_example_gpt_plugins fulgur_strategy_model_parallel \
  fulgur_strategy_single_device fulgur_bench_step_probe -- -j"${FULGUR_JOBS:-2}" >/dev/null
build="$(cd "$FULGUR_BUILD_DIR" && pwd)"
corpus="$(mktemp -d)/corpus.txt"
trap 'rm -rf "$(dirname "$corpus")"' EXIT
"$FULGUR_VENV/bin/python" - "$corpus" <<'PY'
import random, sys
words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
rng = random.Random(7)
with open(sys.argv[1], "w") as f:
    f.write(" ".join(rng.choice(words) for _ in range(60000)))
PY
exec "$FULGUR_VENV/bin/python" "$here/python/tensor_parallel.py" --fulgur "$build/bin/fulgur" --build "$build" \
  --corpus "$corpus" "$@"
