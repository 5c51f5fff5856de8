#!/usr/bin/env bash
# The main command: installs what is missing, builds, and trains the Fashion-MNIST example from its
# TOML file (every plugin selected by name), on the CPU. Extra arguments go to the example.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/build.sh"
cd "$here/.."
"$FULGUR_BUILD_DIR/bin/fulgur" plugins list
exec "$FULGUR_BUILD_DIR/bin/fashion_mnist" --config examples/fashion_mnist/fashion_mnist.toml "$@"
