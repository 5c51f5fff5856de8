#!/usr/bin/env bash
# Builds Fulgur with sanitizers in separate build directories and runs the test suite there.
# Not run by CI (a sanitized build of everything takes long on small machines).
#
#   scripts/sanitize.sh [--asan | --tsan | --all] [-R CTEST_REGEX] [--target T ...] [--no-tests]
#     --asan (default)  ASan + UBSan (+ LeakSanitizer), build-asan/, whole suite or the -R subset
#     --tsan            TSan, build-tsan/, the launcher, registry and loader-worker tests
#                       (default -R: launcher|ddp|registry|plugin|num_workers|worker)
#     --all             both
#     --no-tests        build only
#
# libtorch is not instrumented. Suppressions for findings inside libtorch live in
# scripts/sanitizers/*.supp, each with its reason; a finding in Fulgur's own code is a bug.
# Every sanitized process writes its reports to <build>/sanitizer-reports/ (log_path), so a finding
# in a child process whose failure a test expects is counted too. The script fails if any test
# fails or any report was written.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."

modes=()
regex=""
targets=(fulgur fulgur_tests)
run_tests=1
while (($#)); do
  case "$1" in
    --asan) modes+=(asan); shift ;;
    --tsan) modes+=(tsan); shift ;;
    --all) modes+=(asan tsan); shift ;;
    -R) regex=$2; shift 2 ;;
    --target) targets+=("$2"); shift 2 ;;
    --no-tests) run_tests=0; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
((${#modes[@]})) || modes=(asan)
"$here/setup.sh"
torch_prefix="$("$FULGUR_VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
supp="$here/sanitizers"
cxx="${CXX:-c++}"

# The sanitizer runtimes (libasan, libubsan, libtsan) come with GCC's support library package
# (Debian: libgcc-<version>-dev, which build-essential installs); a minimal toolchain may lack one.
# Link a one-line program with each mode's flags first: a clear error now, not after a cold build.
probe_runtime() {
  local probe
  probe="$(mktemp -d)"
  echo 'int main() { return 0; }' >"$probe/p.cpp"
  if ! "$cxx" $1 "$probe/p.cpp" -o "$probe/p" 2>"$probe/err" || ! "$probe/p"; then
    echo "sanitize.sh: $cxx cannot build or run a program with $1: $(head -1 "$probe/err")" >&2
    echo "  install the sanitizer runtimes of your compiler (Debian: apt-get install build-essential," \
      "or libasan8 libubsan1 libtsan2 for GCC 12)" >&2
    rm -rf "$probe"
    return 1
  fi
  rm -rf "$probe"
}

status=0
for mode in "${modes[@]}"; do
  dir="build-$mode"
  reports="$PWD/$dir/sanitizer-reports"
  exclude=""
  lsan_crashes=""
  case "$mode" in
    asan)
      flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
      test_regex="$regex"
      # handle_segv/sigbus/sigfpe=0: a fatal signal keeps its default action, as in the ordinary
      # build. Fulgur's crash reporter (registry/src/crash_report.cpp) names the plugin and re-raises
      # the signal so the process dies of it; the tests check that status (SIGSEGV, SIGFPE), which
      # ASan's own handler would turn into a report and an abort. A wild access still kills the test.
      export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:handle_segv=0:handle_sigbus=0:handle_sigfpe=0:log_path=$reports/asan:${ASAN_OPTIONS_EXTRA:-}"
      export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
      export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:suppressions=$supp/ubsan.supp:log_path=$reports/ubsan"
      # Tests that cannot hold under ASan, by design of the sanitizer, not of Fulgur:
      #   host malloc: ...  ASan replaces malloc, and its mallopt() does nothing and returns 0, so
      #                     the tuned glibc policy (core/src/host_memory.cpp) cannot apply, and
      #                     the page-fault comparison measures ASan's allocator.
      exclude="^host malloc: "
      # Tests whose processes crash LeakSanitizer itself at exit, run again below with leak
      # detection off (ASan and UBSan stay on). The resumed run of this test exits normally, then
      # LSan's tracer dies scanning a thread's dynamic TLS ("DTLS 27 at 0x000000058568-
      # 0x00640005966a", "Tracer caught signal 11"): a bogus range from GCC 12's sanitizer runtime
      # reading glibc's DTV, not a finding. Reproduced 3 of 3; with detect_leaks=0 it passes with no
      # report; use_tls=0 avoids the crash but reports objects only TLS points to as leaks.
      lsan_crashes='^contract v2: ckpt_path = "last" resumes a run killed mid-epoch'
      ;;
    tsan)
      flags="-fsanitize=thread -fno-omit-frame-pointer"
      test_regex="${regex:-launcher|ddp|registry|plugin|num_workers|worker}"
      # One called_from_lib line per library of the torch wheel (see tsan.supp): generated, since
      # the names change with the torch version.
      mkdir -p "$dir"
      tsan_supp="$PWD/$dir/tsan.supp"
      cp "$supp/tsan.supp" "$tsan_supp"
      site="$("$FULGUR_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
      wheel_libs="$(find -L "$site/torch/lib" "$site/nvidia" /usr/local/cuda/lib /usr/local/cuda/lib64 -name '*.so*' \
        2>/dev/null | sed 's#.*/##' | grep -v '^libgomp' | sort -u)"
      sed 's#^#called_from_lib:#' <<<"$wheel_libs" >>"$tsan_supp"
      # Their static initialisers run from ld.so, so no frame of theirs is on the stack: match the
      # mutex's location (a global of the library) instead.
      sed 's#^#mutex:#' <<<"$wheel_libs" >>"$tsan_supp"
      # ignore_noninstrumented_modules: what an uninstrumented library does through an interceptor
      # (an atexit handler of libcusparse unlocking its own, already destroyed mutex) is not judged.
      # handle_segv/sigbus/sigfpe=0: as under ASan, the crash fixtures' signals keep their default
      # action and Fulgur's crash reporter names the plugin. detect_deadlocks=0: TSan's lock-order
      # detector tracks at most 64 locks held by one thread and CHECK-fails past that (seen in the
      # ddp runs: c10d and libtorch hold more); data races are still detected.
      export TSAN_OPTIONS="halt_on_error=1:ignore_noninstrumented_modules=1:handle_segv=0:handle_sigbus=0:handle_sigfpe=0:detect_deadlocks=0:suppressions=$tsan_supp:log_path=$reports/tsan"
      # Cannot hold under TSan: a fixture plugin that throws from its static initialiser unwinds
      # through TSan's __cxa_atexit interceptor, which then never ends the "ignore" it began, and
      # TSan fails the checking child at exit ("main thread finished with ignores enabled"); the
      # test runs under ASan and in the normal suite.
      exclude="^plugins check: each crash class"
      ;;
  esac
  probe_runtime "$flags"
  if [ ! -f "$dir/build.ninja" ]; then
    # RelWithDebInfo keeps line tables for the reports; plugins and tests get the flags too.
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_PREFIX_PATH="$torch_prefix" \
      -DFULGUR_PYTHON="$FULGUR_VENV/bin/python" -DCMAKE_CXX_COMPILER_LAUNCHER=ccache \
      -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_SHARED_LINKER_FLAGS="$flags"
  fi
  # Before the build: it runs sanitized programs too (doctest_discover_tests lists the test cases).
  rm -rf "$reports"
  mkdir -p "$reports"
  cmake --build "$dir" --target "${targets[@]}"
  ((run_tests)) || continue
  echo "== $mode: ctest ${test_regex:+-R '$test_regex'} ${exclude:+-E '$exclude'}${lsan_crashes:+ (and, below, $lsan_crashes)}"
  # Plugins are shared objects loaded into sanitized executables: the runtime is already there.
  skip="$exclude"
  [ -n "$lsan_crashes" ] && skip="${skip:+$skip|}$lsan_crashes"
  if ! ctest --test-dir "$dir" -j2 --output-on-failure ${test_regex:+-R "$test_regex"} ${skip:+-E "$skip"} \
      -LE 'bench|packaging' 2>&1 | tee "$dir/sanitize.log"; then
    status=1
  fi
  if [ -n "${lsan_crashes:-}" ] && [ -z "$test_regex" ]; then
    echo "== $mode: without leak detection (LeakSanitizer crashes in these): $lsan_crashes"
    if ! ASAN_OPTIONS="${ASAN_OPTIONS/detect_leaks=1/detect_leaks=0}" ctest --test-dir "$dir" --output-on-failure \
        -R "$lsan_crashes" 2>&1 | tee -a "$dir/sanitize.log"; then
      status=1
    fi
  fi
  shopt -s nullglob
  found=("$reports"/*)
  shopt -u nullglob
  if ((${#found[@]})); then
    echo "== $mode: ${#found[@]} sanitizer report(s) in $reports:"
    grep -h -E "ERROR: (Address|Leak|Thread)Sanitizer|runtime error:|WARNING: ThreadSanitizer|SUMMARY:" \
      "${found[@]}" | sort | uniq -c
    status=1
  else
    echo "== $mode: no sanitizer reports"
  fi
done
exit $status
