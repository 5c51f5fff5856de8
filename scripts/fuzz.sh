#!/usr/bin/env bash
# Coverage-guided fuzzing of Fulgur's readers with libFuzzer (clang, ASan + UBSan):
#   config        TOML config: parse_config + validate_plugins against the built-in plugins' schemas
#   elf_note      the plugin ELF-note reader
#   checkpoint    the checkpoint reader (zip framing, torch archive reader, unpickler)
#   idx           the Fashion-MNIST IDX reader (plain and gzip)
#   safetensors   the safetensors reader (header, dtypes, shapes, offsets)
#   csv           CSV records (read_csv_record round-tripped through csv_field) and CsvDataset
#   image         JPEG and PNG decoding through ImageFolder
#   tar           the WebDataset tar shard reader (ustar, pax, GNU long names)
#   token         the token file reader (the GPT example's uint16/uint32 token windows)
#   dcp_metadata  the distributed checkpoint reader: `.metadata` unpickler, then reading it all
# Each runs from its committed seed corpus (tests/fuzz/corpus/<t>/) for --runs executions, or for
# --seconds of wall time (libFuzzer's -max_total_time; then --runs is no limit); new inputs go to
# $FULGUR_FUZZ_BUILD_DIR/corpus/<t>/, crashes to $FULGUR_FUZZ_BUILD_DIR/artifacts/<t>/. The summary
# gives per target the executions, exec/s, corpus size and peak RSS of libFuzzer's last report.
# CI does not run this: the test suite runs the same entry functions over the seeds (fuzz_smoke_test).
# --jobs J: build parallelism of the instrumented build (default: CMAKE_BUILD_PARALLEL_LEVEL or ninja's);
# --no-build: run the executables already in $FULGUR_FUZZ_BUILD_DIR (e.g. while it builds others).
#
# usage: scripts/fuzz.sh [--runs N | --seconds S] [--targets config,elf_note,...] [--jobs J] [--no-build]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."

runs=20000
seconds=0
build=1
targets="config,elf_note,checkpoint,idx,safetensors,csv,image,tar,token,dcp_metadata"
while (($#)); do
  case "$1" in
    --runs) runs=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --targets) targets=$2; shift 2 ;;
    --jobs) export CMAKE_BUILD_PARALLEL_LEVEL=$2; shift 2 ;;
    --no-build) build=0; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

fuzz_dir="${FULGUR_FUZZ_BUILD_DIR:-build-fuzz}"
IFS=, read -r -a list <<<"$targets"
if ((build)); then
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
  if [[ ",$targets," == *,config,* && ! -d "$FULGUR_BUILD_DIR/lib/fulgur/plugins" ]]; then
    "$here/build.sh" --target fulgur
  fi

  if [ ! -f "$fuzz_dir/build.ninja" ]; then
    torch_prefix="$("$FULGUR_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
    # The libraries under test are instrumented for coverage and the sanitizers; the fuzz targets
    # add -fsanitize=fuzzer themselves. libtorch itself is not instrumented.
    CC=clang CXX=clang++ cmake -S . -B "$fuzz_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
      -DCMAKE_PREFIX_PATH="$torch_prefix" -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DFULGUR_FUZZ=ON -DBUILD_TESTING=OFF \
      -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  fi
  cmake --build "$fuzz_dir" --target "${list[@]/#/fulgur_fuzz_}"
fi
plugin_dir="$(cd "$FULGUR_BUILD_DIR/lib/fulgur/plugins" 2>/dev/null && pwd || true)"

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
  if ((seconds > 0)); then
    budget=(-max_total_time="$seconds")
    echo "== $t: $seconds seconds (log: $log)"
  else
    budget=(-runs="$runs")
    echo "== $t: $runs executions (log: $log)"
  fi
  if "$fuzz_dir/bin/fulgur_fuzz_$t" "${budget[@]}" -max_len=65536 -timeout=25 -rss_limit_mb=4096 -print_final_stats=1 \
      -artifact_prefix="$artifacts/" "$corpus" "tests/fuzz/corpus/$t" >"$log" 2>&1; then
    result="ok"
  else
    result="FINDING (see $log and $artifacts/)"
    status=1
  fi
  # libFuzzer's last status line: "#N <event> cov: .. ft: .. corp: C/Sb ... exec/s: E rss: RMb".
  last="$(grep -E '^#[0-9]+' "$log" | tail -1 || true)"
  execs="$(sed -nE 's/^#([0-9]+).*/\1/p' <<<"$last")"
  corp="$(sed -nE 's/.* corp: ([0-9]+\/[0-9]+[a-zA-Z]*).*/\1/p' <<<"$last")"
  rate="$(sed -nE 's/.* exec\/s: ([0-9]+).*/\1/p' <<<"$last")"
  rss="$(sed -nE 's/.* rss: ([0-9]+Mb).*/\1/p' <<<"$last")"
  peak="$(sed -nE 's/^stat::peak_rss_mb: *([0-9]+).*/\1Mb/p' "$log" | tail -1)"
  time_line="$(grep -E '^Done [0-9]+ runs in [0-9]+ second' "$log" | tail -1 || true)"
  summary+=("$(printf '%-12s executions %s, exec/s %s, corpus %s, peak RSS %s; %s; %s' "$t" "${execs:-?}" \
    "${rate:-?}" "${corp:-?}" "${peak:-${rss:-?}}" "${time_line:-no Done line}" "$result")")
done
echo
printf '%s\n' "${summary[@]}"
exit $status
