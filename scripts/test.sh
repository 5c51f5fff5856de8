#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs the whole suite via CTest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/build.sh"
cd "$here/.."
ctest --test-dir "$FULGUR_BUILD_DIR" --output-on-failure -j2 "$@"
