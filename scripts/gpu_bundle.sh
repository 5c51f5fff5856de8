#!/usr/bin/env bash
# Packs a GPU machine's check for a machine that can install nothing (no network, no apt, a torch
# of its own): the built programs and plugins (debug info stripped), the shared libraries they need
# from this machine (not glibc's, libstdc++'s, torch's or the driver's), the CTest files and the
# Fashion-MNIST files, in one folder:
#
#   scripts/gpu_bundle.sh [BUNDLE_DIR]        default .gpu_bundle (ignored by git)
#
# then, on the GPU machine, in a copy of this checkout with the folder beside it:
#
#   scripts/gpu_check.sh --prebuilt BUNDLE_DIR RESULTS_DIR
#
# The programs keep the absolute paths they were built with (the build folder, the venv's torch);
# gpu_check.sh --prebuilt recreates those paths there, pointing at that machine's own torch, which
# must be the same torch release (the plugin ABI check refuses any other).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."
bundle="${1:-.gpu_bundle}"
"$here/build.sh" -- -j"${FULGUR_JOBS:-2}"
build="$(cd "$FULGUR_BUILD_DIR" && pwd)"
[ -f "$build/lib/fulgur/plugins/libfulgur-accelerator-cuda.so" ] || {
  echo "gpu_bundle: no cuda accelerator plugin in $build (is the torch wheel a CUDA build?)" >&2
  exit 1
}
rm -rf "$bundle"
mkdir -p "$bundle"
bundle="$(cd "$bundle" && pwd)"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

# 1. The build's runtime files at their places under the build folder.
(
  cd "$build"
  {
    for program in fulgur_tests fashion_mnist fashion_mnist_cli bench_compare fulgur fulgur_ddp_worker fulgur_data_job \
      fulgur_cuda_hooks_builder_probe; do
      echo "bin/$program"
    done
    find . -name 'libfulgur_cuda_hooks_report.so' -printf '%P\n' # the CUDA-hooks check's preload
    find lib -name '*.so*' \( -type f -o -type l \)
    find tests/fixtures/plugins -name '*.so' 2>/dev/null
    find . -name CTestTestfile.cmake -printf '%P\n'
    find tests -maxdepth 1 -name 'fulgur_tests_*.cmake'
  } | sort -u >"$stage/files"
  tar -cf - -T "$stage/files" | tar -xf - -C "$stage" --one-top-level=build
)
find "$stage/build" -type f \( -name '*.so*' -o -path '*/bin/*' \) -exec strip --strip-debug {} +
tar -C "$stage/build" -cJf "$bundle/build.tar.xz" .
echo "$build" >"$bundle/build_dir"
git rev-parse --short HEAD >"$bundle/commit" 2>/dev/null || echo '?' >"$bundle/commit"
echo "$FULGUR_VENV" >"$bundle/venv_dir"
"$FULGUR_VENV/bin/python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' \
  >"$bundle/site_dir"
"$FULGUR_VENV/bin/python" -c 'import torch; print(torch.__version__)' >"$bundle/torch_version"

# 2. Shared libraries resolved here that a fresh image may lack.
mkdir -p "$stage/syslibs"
find "$stage/build" -type f \( -name '*.so*' -o -path '*/bin/*' \) -print0 | xargs -0 ldd >"$stage/ldd" 2>/dev/null || true
if grep -q 'not found' "$stage/ldd"; then
  echo "gpu_bundle: libraries not found here:" >&2
  grep 'not found' "$stage/ldd" | sort -u >&2
  exit 1
fi
awk '/=> \//{print $3}' "$stage/ldd" | sort -u |
  grep -v -E '/(libc|libm|libdl|libpthread|librt|libresolv|libutil|libanl|libnsl|ld-linux-x86-64|libstdc\+\+|libgcc_s)\.so' |
  grep -v -E '/torch/lib/|/nvidia/|libcuda\.so|/build/lib/' |
  while read -r lib; do cp -L "$lib" "$stage/syslibs/"; done
# The cuda plugin's CUDA runtime: its RUNPATH names /usr/local/cuda/lib, which that machine may lack.
ls "$stage/syslibs"/libcudart.so.* >/dev/null 2>&1 || {
  echo "gpu_bundle: libcudart was not among the libraries the cuda plugin resolved" >&2
  exit 1
}
tar -C "$stage/syslibs" -cJf "$bundle/syslibs.tar.xz" .

# 3. The example's data.
mkdir -p "$bundle/fashion-mnist"
cp /usr/share/datasets/fashion-mnist/*.gz "$bundle/fashion-mnist/"
du -sh "$bundle"/*
du -sh "$bundle"
