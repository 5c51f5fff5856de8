#!/usr/bin/env bash
# Configures (once) and builds Fulgur into $FULGUR_BUILD_DIR (default build/).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/setup.sh"
cd "$here/.."
if [ ! -f "$FULGUR_BUILD_DIR/build.ninja" ]; then
  torch_prefix="$("$FULGUR_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>/dev/null)"
  cmake -S . -B "$FULGUR_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE="${FULGUR_BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DFULGUR_PYTHON="$FULGUR_VENV/bin/python" \
    -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
fi
cmake --build "$FULGUR_BUILD_DIR" "$@"
