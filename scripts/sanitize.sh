#!/usr/bin/env bash
# Builds Fulgur with sanitizers in separate build directories and runs the test suite there.
# Not run by CI (a sanitized build of everything takes long on small machines).
#
#   scripts/sanitize.sh [--asan | --tsan | --all] [-R CTEST_REGEX] [--target T ...]
#     --asan (default)  ASan + UBSan, build-asan/, whole suite or the -R subset
#     --tsan            TSan, build-tsan/, the launcher, registry and loader-worker tests
#                       (default -R: launcher|ddp|registry|plugin|num_workers|worker)
#     --all             both
#
# libtorch is not instrumented. Suppressions for findings inside libtorch live in
# scripts/sanitizers/*.supp, each with its reason; a finding in Fulgur's own code is a bug.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."

modes=()
regex=""
targets=(fulgur fulgur_tests)
while (($#)); do
  case "$1" in
    --asan) modes+=(asan); shift ;;
    --tsan) modes+=(tsan); shift ;;
    --all) modes+=(asan tsan); shift ;;
    -R) regex=$2; shift 2 ;;
    --target) targets+=("$2"); shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
((${#modes[@]})) || modes=(asan)
"$here/setup.sh"
torch_prefix="$("$FULGUR_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
supp="$here/sanitizers"

status=0
for mode in "${modes[@]}"; do
  dir="build-$mode"
  case "$mode" in
    asan)
      flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
      test_regex="$regex"
      export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:detect_odr_violation=0:${ASAN_OPTIONS_EXTRA:-}"
      export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
      export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp"
      ;;
    tsan)
      flags="-fsanitize=thread -fno-omit-frame-pointer"
      test_regex="${regex:-launcher|ddp|registry|plugin|num_workers|worker}"
      export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$supp/tsan.supp"
      ;;
  esac
  if [ ! -f "$dir/build.ninja" ]; then
    # RelWithDebInfo keeps line tables for the reports; plugins and tests get the flags too.
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
      -DFULGUR_PYTHON="$FULGUR_VENV/bin/python" -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
      -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags"
  fi
  cmake --build "$dir" --target "${targets[@]}"
  echo "== $mode: ctest ${test_regex:+-R '$test_regex'}"
  # Plugins are shared objects loaded into sanitized executables: the runtime is already there.
  if ! ctest --test-dir "$dir" -j2 --output-on-failure ${test_regex:+-R "$test_regex"} -LE 'bench|packaging' \
      2>&1 | tee "$dir/sanitize.log"; then
    status=1
  fi
  grep -E "ERROR: (Address|Leak|Thread)Sanitizer|runtime error:|WARNING: ThreadSanitizer" "$dir/sanitize.log" \
    | sort | uniq -c || echo "$mode: no sanitizer reports"
done
exit $status
