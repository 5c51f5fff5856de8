#!/usr/bin/env bash
# Distributed speed side by side: the GPT example (examples/gpt) on 2 Gloo ranks, Fulgur `ddp` and
# `fsdp` zero_stage 1/2/3 (`fulgur fit`) against Lightning 2.6.6 DDPStrategy and FSDP2
# (ModelParallelStrategy + fully_shard; FULL_SHARD and SHARD_GRAD_OP) on the same model in Python
# (bench/python/gpt_lightning.py): same initial weights, data order and optimizer, checked by the
# losses of the first steps before any ratio. Prints markdown tables: step time, peak RSS and page
# faults per rank, bytes sent per step per rank (measured, next to the formula), start to first
# step, and Fulgur ÷ Lightning with ranges over interleaved runs (bench/python/distributed.py).
#
#   bench/distributed.sh                          all sides, 3 interleaved runs, 30 steps (~5 min on 2 cores)
#   bench/distributed.sh --runs 1 --steps 8       smoke run
#   bench/distributed.sh --sides fulgur-ddp,lightning-ddp --json /tmp/d.json
#   bench/distributed.sh --sides fulgur-single,fulgur-ddp,fulgur-z2,fulgur-z3 --overlap   hidden share
#   bench/distributed.sh --sides fulgur-z2,fulgur-z2-blocking,lightning-fsdp-grad-op --overlap --reduce-bucket-mb 1
#       hidden share with and without overlap_reduce (a `-blocking` side), Lightning under torch.profiler
#   bench/distributed.sh --model cnn --batch-size 64 --lr 1e-3 --sides fulgur-single,fulgur-ddp,fulgur-z1,fulgur-z2
#       the Fashion-MNIST CNN (examples/fashion_mnist), Fulgur sides only
#
# Builds `fulgur`, the GPT and Fashion-MNIST plugins and bench_step_probe in $FULGUR_BUILD_DIR (default build/);
# FULGUR_JOBS caps the build's parallelism (default 2). Other arguments go to distributed.py (--help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" --target fulgur fulgur_example_gpt_plugins fulgur_example_fashion_mnist_plugins \
  fulgur_strategy_ddp fulgur_strategy_fsdp \
  fulgur_bench_step_probe -- -j"${FULGUR_JOBS:-2}" >/dev/null
build="$(cd "$FULGUR_BUILD_DIR" && pwd)"
exec "$FULGUR_VENV/bin/python" "$here/python/distributed.py" --fulgur "$build/bin/fulgur" --build "$build" "$@"
