#!/usr/bin/env bash
# Checks the SDK's ABI, as the current headers declare it, against every stored release baseline
# (tests/abi/baseline/fulgur-sdk-*.abi; CTest runs the same check as abi_sdk_against_baselines):
#   scripts/abi_check.sh                        # exit 1 and abidiff's report on an incompatible change
#   scripts/abi_check.sh --write-baseline 1.1   # at release 1.1: store its ABI next to 1.0's
# Builds the probe library (tests/abi/probe.cpp) in $FULGUR_BUILD_DIR first. A release that adds a
# stable type adds a probe for it before writing its baseline.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/build.sh" --target fulgur_abi_probe >/dev/null
cd "$here/.."
exec tests/abi/abi_check.sh "$FULGUR_BUILD_DIR/tests/abi/libfulgur_abi_probe.so" "$@"
