#!/usr/bin/env bash
# expect_incompatible.sh <abi_check.sh> <probe library> <name>: passes only when abi_check.sh
# refuses the probe as an incompatible change and its report names <name> (the inserted function).
set -uo pipefail
output=$(bash "$1" "$2" 2>&1)
status=$?
echo "$output"
if ((status == 0)); then
  echo "expect_incompatible.sh: abi_check.sh accepted a probe with an incompatible change"
  exit 1
fi
if ! grep -q "INCOMPATIBLE change" <<<"$output" || ! grep -q "$3" <<<"$output"; then
  echo "expect_incompatible.sh: abi_check.sh failed, but not by reporting '$3' as an incompatible change"
  exit 1
fi
echo "expect_incompatible.sh: the inserted virtual '$3' was caught"
