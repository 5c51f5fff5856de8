#!/usr/bin/env bash
# The test command: installs what is missing, builds everything, runs the whole suite via CTest,
# then prints the suite's wall time and, alone on the last line, "N passed, N failed, N skipped"
# (skipped: tests that cannot run here, e.g. the gpu: tests without a GPU). Exits with CTest's code.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/build.sh"
cd "$here/.."
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
start="$EPOCHREALTIME"
set +e
ctest --test-dir "$FULGUR_BUILD_DIR" --output-on-failure -j2 "$@" 2>&1 | tee "$log"
status="${PIPESTATUS[0]}"
set -e
end="$EPOCHREALTIME"

# The counts from CTest's own summary: "P% tests passed, F tests failed out of T" (skipped tests
# count as passed there, a test not run for another reason as failed), and the tests it lists
# after "Total Test time" under "The following tests did not run:" (skipped or disabled).
awk -v start="$start" -v end="$end" '
  /^Total Test time/ { summary = 1; next }
  / tests failed out of / { failed = $4; total = $NF; seen = 1 }
  !summary { next }
  /^The following tests did not run:/ { skipping = 1; next }
  skipping && /^[[:space:]]+[0-9]+ - / { skipped++; next }
  { skipping = 0 }
  END {
    printf "test suite wall time: %.1f s\n", end - start
    if (!seen) { print "test counts: no CTest summary (see the output above)"; exit }
    printf "%d passed, %d failed, %d skipped\n", total - failed - skipped, failed, skipped
  }' "$log"
exit "$status"
