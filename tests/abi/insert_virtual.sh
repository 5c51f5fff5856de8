#!/usr/bin/env bash
# insert_virtual.sh <logger.h> <out>: a copy of logger.h with `virtual void inserted_for_abi_check();`
# inserted before Logger's first function, the incompatible change abi_check.sh must catch.
set -euo pipefail
mkdir -p "$(dirname "$2")"
anchor='  virtual void setup(const LoggerSetup& setup) = 0;'
grep -qF "$anchor" "$1" || { echo "insert_virtual.sh: '$anchor' is not in $1; update the anchor" >&2; exit 1; }
sed "s|^$anchor\$|  virtual void inserted_for_abi_check();\n&|" "$1" >"$2"
grep -q inserted_for_abi_check "$2"
