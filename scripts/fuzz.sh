#!/usr/bin/env bash
# Coverage-guided fuzzing of Fulgur's readers with libFuzzer (clang, ASan + UBSan):
#   config      TOML config: parse_config + validate_plugins against the built-in plugins' schemas
#   elf_note    the plugin ELF-note reader
#   checkpoint  the checkpoint reader (zip framing, torch archive reader, unpickler)
#   idx         the Fashion-MNIST IDX reader (plain and gzip)
# Each runs a fixed number of executions from its committed seed corpus (tests/fuzz/corpus/<t>/);
# new inputs go to $FULGUR_FUZZ_BUILD_DIR/corpus/<t>/, crashes to $FULGUR_FUZZ_BUILD_DIR/artifacts/<t>/.
# CI does not run this: the test suite runs the same entry functions over the seeds (fuzz_smoke_test).
#
# usage: scripts/fuzz.sh [--runs N] [--targets config,elf_note,checkpoint,idx] [--jobs J]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."

runs=20000
targets="config,elf_note,checkpoint,idx"
while (($#)); do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

# clang and its libFuzzer runtime, only if missing (not part of the default scripts' packages).
missing=()
for p in clang libclang-rt-dev; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})) && ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  echo "fuzz.sh: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
"$here/setup.sh"

# The config target validates against the built-in plugins' schemas (metadata only): build them
# in the normal build if they are not there.
if [ ! -d "$FULGUR_BUILD_DIR/lib/fulgur/plugins" ]; then
  "$here/build.sh" --target fulgur
fi
plugin_dir="$(cd "$FULGUR_BUILD_DIR/lib/fulgur/plugins" && pwd)"

fuzz_dir="${FULGUR_FUZZ_BUILD_DIR:-build-fuzz}"
if [ ! -f "$fuzz_dir/build.ninja" ]; then
  torch_prefix="$("$FULGUR_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  # The libraries under test are instrumented for coverage and the sanitizers; the fuzz targets
  # add -fsanitize=fuzzer themselves. libtorch itself is not instrumented.
  CC=clang CXX=clang++ cmake -S . -B "$fuzz_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DFULGUR_FUZZ=ON -DBUILD_TESTING=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
fi
IFS=, read -r -a list <<<"$targets"
cmake --build "$fuzz_dir" --target "${list[@]/#/fulgur_fuzz_}"

# LeakSanitizer: libtorch allocates process-lifetime registries at static-initialisation time
# and never frees them (not a Fulgur leak); leaks are not what these runs look for.
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
export FULGUR_PLUGIN_PATH="$plugin_dir"
export FULGUR_LOG_LEVEL=off

status=0
summary=()
for t in "${list[@]}"; do
  corpus="$fuzz_dir/corpus/$t"
  artifacts="$fuzz_dir/artifacts/$t"
  mkdir -p "$corpus" "$artifacts"
  log="$fuzz_dir/fuzz-$t.log"
  echo "== $t: $runs executions (log: $log)"
  if "$fuzz_dir/bin/fulgur_fuzz_$t" -runs="$runs" -max_len=65536 -timeout=25 -rss_limit_mb=4096 \
      -artifact_prefix="$artifacts/" "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1; then
    result="ok"
  else
    result="FINDING (see $log and $artifacts/)"
    status=1
  fi
  done_line="$(grep -E '^Done [0-9]+ runs' "$log" | tail -1 || true)"
  summary+=("$(printf '%-10s %s; %s' "$t" "${done_line:-no Done line}" "$result")")
done
echo
printf '%s\n' "${summary[@]}"
exit $status
