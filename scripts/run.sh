#!/usr/bin/env bash
# The main command: installs what is missing, builds, and trains the Fashion-MNIST example from its
# TOML file with `fulgur fit` (the model, the data and every plugin selected by name), on the CPU,
# then tests the best checkpoint with `fulgur test`. Extra arguments (--trainer.max_epochs=2, ...)
# go to both.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
"$here/build.sh"
cd "$here/.."
"$FULGUR_BUILD_DIR/bin/fulgur" plugins list
config=examples/fashion_mnist/fashion_mnist.toml
"$FULGUR_BUILD_DIR/bin/fulgur" fit --config "$config" "$@"
exec "$FULGUR_BUILD_DIR/bin/fulgur" test --config "$config" "$@" --ckpt_path=best
