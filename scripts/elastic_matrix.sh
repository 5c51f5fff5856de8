#!/usr/bin/env bash
# The whole elastic resharding matrix (issue #39): mid-epoch checkpoints written by 1, 2 and 3
# processes resume on 1, 2 and 3 under ddp (full checkpoints) and fsdp ZeRO-3 (sharded ones), and
# every sample of the epoch is trained once. The suite's test case runs a few of the 18 cells;
# this runs all of them (about 24 short multi-process runs over loopback Gloo).
#   scripts/elastic_matrix.sh            # builds, then runs the test case with the full matrix
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/build.sh" --target fulgur_tests fulgur_ddp_worker >/dev/null
FULGUR_TEST_ELASTIC_FULL_MATRIX=1 exec "$FULGUR_BUILD_DIR/bin/fulgur_tests" \
  -tc="elastic: resharding matrix*" "$@"
