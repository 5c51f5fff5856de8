#!/usr/bin/env bash
# Images/s through the image-folder pipeline (decode, random resized crop 224, flip, normalize,
# batches of 64): Fulgur's DataLoader (worker threads) vs PyTorch's DataLoader with torchvision
# transforms (worker processes), on the same generated JPEG files, at 1 and 2 workers, interleaved
# runs, medians and ranges (bench/python/data_pipeline.py).
#
#   bench/data_pipeline.sh                          640 images of 500x375, 3 runs, workers 1 and 2
#   bench/data_pipeline.sh --images 128 --runs 1    smoke run
#   bench/data_pipeline.sh --dir PATH               an existing image folder instead
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
"$here/../scripts/build.sh" --target bench_data_pipeline -- -j"${FULGUR_JOBS:-2}"
exec "$FULGUR_VENV/bin/python" "$here/python/data_pipeline.py" \
  --bench "$(cd "$FULGUR_BUILD_DIR" && pwd)/bin/bench_data_pipeline" "$@"
