#!/usr/bin/env bash
# Proves that the ABI corpus was compiled against the frozen SDK 1.0 headers only: for each object,
# the headers the compiler read (Ninja's dependency log) include the frozen copy's fulgur/plugin.h,
# and no fulgur/ header from anywhere else (sdk/include, core/include, ... of the current tree).
#   frozen_headers_check.sh <ninja> <build dir> <frozen include dir> <object (relative to the build)>...
set -euo pipefail
ninja=$1 build=$2 frozen=$(realpath "$3")
shift 3
status=0
for object in "$@"; do
  deps=$("$ninja" -C "$build" -t deps "$object")
  if ! head -n 1 <<<"$deps" | grep -q "(VALID)"; then
    echo "FAIL $object: no valid dependency record (build the fulgur_abi_corpus target first)"
    status=1
    continue
  fi
  count=0 plugin_h=0
  while read -r header; do
    path=$(cd "$build" && realpath -m "$header")
    if [[ $path != "$frozen"/* ]]; then
      echo "FAIL $object: compiled with $path, not the frozen 1.0 copy"
      status=1
    fi
    count=$((count + 1))
    [[ $path == "$frozen/fulgur/plugin.h" ]] && plugin_h=1
  done < <(tail -n +2 <<<"$deps" | sed 's/^ *//' | grep '/include/fulgur/' || true)
  if ((plugin_h == 0)); then
    echo "FAIL $object: did not read $frozen/fulgur/plugin.h"
    status=1
  fi
  echo "$object: $count fulgur/ headers read, from $frozen"
done
exit $status
