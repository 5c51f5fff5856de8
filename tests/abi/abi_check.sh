#!/usr/bin/env bash
# The SDK's ABI against every stored release baseline (tests/abi/baseline/fulgur-sdk-<version>.abi).
#
#   abi_check.sh <probe library>                            # compare; exit 1 on an incompatible change
#   abi_check.sh <probe library> --write-baseline <version> # store the probe's ABI as that release's
#
# The probe (probe.cpp, target fulgur_abi_probe) exports one function per stable SDK type; abidw
# (libabigail, Debian package abigail-tools) dumps the layouts and vtables its debug info describes,
# keeping Fulgur's own headers only (abidw.suppr: std and torch types stay as names, their insides
# are pinned by the plugin ABI tag), and abidiff compares that with each baseline. abidiff's exit
# status is a bit set: 1 error, 2 usage error, 4 the ABI changed, 8 an incompatible change. A change
# passes only when it adds (new types reached by new probe functions, new enumerators): any removed
# or changed function, i.e. a changed type, vtable or signature, fails and the report is printed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
abidw=${FULGUR_ABIDW:-abidw}
abidiff=${FULGUR_ABIDIFF:-abidiff}
probe=${1:?usage: abi_check.sh <probe library> [--write-baseline <version>]}

current=$(mktemp --suffix=.abi)
report=$(mktemp)
trap 'rm -f "$current" "$report"' EXIT
# No locations, paths or DT_NEEDED entries: the dump depends on the headers only, not on where the
# tree or the torch wheel lives.
"$abidw" --no-show-locs --no-corpus-path --no-comp-dir-path --no-elf-needed \
  --suppressions "$here/abidw.suppr" --out-file "$current" "$probe"
# The translation unit's path (relative under ccache, absolute without) is not part of the ABI.
sed -i "s#<abi-instr \(.*\) path='[^']*'#<abi-instr \1 path='probe.cpp'#" "$current"

if [ "${2:-}" = "--write-baseline" ]; then
  version=${3:?--write-baseline needs the release version, e.g. 1.1}
  cp "$current" "$here/baseline/fulgur-sdk-$version.abi"
  echo "wrote $here/baseline/fulgur-sdk-$version.abi"
  exit 0
fi

shopt -s nullglob
baselines=("$here"/baseline/fulgur-sdk-*.abi)
if ((${#baselines[@]} == 0)); then
  echo "no baseline in $here/baseline"
  exit 1
fi
status=0
for baseline in "${baselines[@]}"; do
  name=$(basename "$baseline" .abi)
  rc=0
  "$abidiff" --no-unreferenced-symbols "$baseline" "$current" >"$report" 2>&1 || rc=$?
  # "Functions changes summary: R Removed, C Changed (F filtered out), A Added functions", same for
  # variables: filtered changes are libabigail's harmless ones.
  summaries=0 removed_or_changed=0
  while read -r removed changed; do
    summaries=$((summaries + 1))
    removed_or_changed=$((removed_or_changed + removed + changed))
  done < <(sed -nE 's/^(Functions|Variables) changes summary: ([0-9]+) Removed, ([0-9]+) Changed.*/\2 \3/p' "$report")
  if ((rc == 0)); then
    echo "$name: no ABI change"
  elif ((rc & 3)); then
    echo "$name: abidiff failed (exit status $rc)"
    cat "$report"
    status=1
  elif ((rc & 8 || removed_or_changed > 0 || summaries == 0)); then
    echo "$name: INCOMPATIBLE change of the SDK ABI (abidiff exit status $rc); plugins built against it break:"
    cat "$report"
    status=1
  else
    echo "$name: compatible additions only (abidiff exit status $rc):"
    cat "$report"
  fi
done
exit $status
