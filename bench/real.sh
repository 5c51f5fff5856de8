#!/usr/bin/env bash
# The real example end to end: build/bin/fashion_mnist with examples/fashion_mnist's TOML vs the same
# program under PyTorch Lightning (bench/python/real_lightning.py), on the Fashion-MNIST files that
# scripts/setup.sh installs. Prints markdown tables: epoch time, CPU, system time, page faults and
# peak RSS per side (medians and ranges over interleaved runs) and the ratios to Lightning.
#
#   bench/real.sh                                  CNN and MLP, 1 epoch, 5 interleaved runs
#   bench/real.sh --runs 3 --models cnn            fewer
#   bench/real.sh --sides fulgur,lightning,fulgur-glibc,fulgur-jemalloc,fulgur-mimalloc,fulgur-tcmalloc,fulgur-caching
#                                                  the host-memory candidates of issue #16 (the preloads
#                                                  need libjemalloc2, libmimalloc2.0, libtcmalloc-minimal4)
#   bench/real.sh --limit-batches 3 --runs 1       smoke run (seconds)
#
# Builds fashion_mnist (and the plugins its TOML selects) in $FULGUR_BUILD_DIR (default build/);
# FULGUR_JOBS caps the build's parallelism (default 2). Other arguments go to real.py (--help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" --target fashion_mnist fulgur_bench_caching_allocator -- -j"${FULGUR_JOBS:-2}"
exec "$FULGUR_VENV/bin/python" "$here/python/real.py" --fulgur "$(cd "$FULGUR_BUILD_DIR" && pwd)/bin/fashion_mnist" "$@"
