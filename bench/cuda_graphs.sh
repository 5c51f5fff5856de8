#!/usr/bin/env bash
# Captured training steps (`[trainer] cuda_graphs = "on"`) against uncaptured Fulgur and the
# hand-written LibTorch loop on the small GPT, in 32-true and bf16-mixed, with MFU (issue #12).
#
#   bench/cuda_graphs.sh                         on the GPU: gpt:16 and gpt:64, 3 interleaved runs
#   bench/cuda_graphs.sh --runs 5 --cases gpt:16:500:50
#   bench/cuda_graphs.sh --device cpu --cases gpt:4:6:2 --runs 1   smoke test (the captured side is refused)
#
# Builds bench_compare in $FULGUR_BUILD_DIR (default build/); other arguments go to
# bench/python/cuda_graphs.py (--help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" --target bench_compare -- -j"${FULGUR_JOBS:-2}"
exec "$FULGUR_VENV/bin/python" "$here/python/cuda_graphs.py" --bench-compare "$FULGUR_BUILD_DIR/bin/bench_compare" "$@"
