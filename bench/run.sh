#!/usr/bin/env bash
# Builds bench_step_time (and the plugins the Trainer loads) in $FULGUR_BUILD_DIR (default build/)
# and runs both measurements: step time (Fulgur Trainer vs hand-written loop) and time to the
# first step. Extra arguments go to the step-time run, e.g. `bench/run.sh --quick` or `--runs 7`.
# FULGUR_JOBS caps the build's parallelism (default 2).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/../scripts/env.sh"
cd "$here/.."
# Only what the bench needs (the target depends on the plugins its Trainer loads).
"$here/../scripts/build.sh" --target bench_step_time -- -j"${FULGUR_JOBS:-2}"
bench="$FULGUR_BUILD_DIR/bin/bench_step_time"
# Info-level Trainer logs (plugin loading, checkpoints) would interleave with the tables.
export FULGUR_LOG_LEVEL="${FULGUR_LOG_LEVEL:-warn}"
"$bench" "$@"
"$bench" --startup
