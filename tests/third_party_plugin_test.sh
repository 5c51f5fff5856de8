#!/usr/bin/env bash
# Packaging test, run by CTest: installs Fulgur into a fresh prefix, builds
# examples/third_party_plugin out of tree against that installed SDK exactly as a third party would
# (find_package(Fulgur) + fulgur_add_plugin), then checks with the installed `fulgur` that the
# plugin is found by name, its options are validated, and it loads and is created.
#
# usage: third_party_plugin_test.sh SOURCE_DIR BUILD_DIR WORK_DIR TORCH_PREFIX GENERATOR [LAUNCHER]
set -euo pipefail
source_dir=$1 build_dir=$2 work=$3 torch_prefix=$4 generator=$5 launcher=${6:-}

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
# expect_output "what" "needle" command...: the command succeeds and prints the needle.
expect_output() {
  local what=$1 needle=$2 out
  shift 2
  out=$("$@" 2>&1) || fail "$what: exited with $?:"$'\n'"$out"
  grep -qF -- "$needle" <<<"$out" || fail "$what: output lacks '$needle':"$'\n'"$out"
  echo "ok: $what"
}
# expect_error "what" "needle" command...: the command fails and its message has the needle.
expect_error() {
  local what=$1 needle=$2 out
  shift 2
  if out=$("$@" 2>&1); then fail "$what: succeeded, expected an error:"$'\n'"$out"; fi
  grep -qF -- "$needle" <<<"$out" || fail "$what: error lacks '$needle':"$'\n'"$out"
  echo "ok: $what"
}

# A stable work directory (not mktemp) keeps compiler command lines identical between runs, so
# ccache serves the example's object file; it also stays behind for inspection after a failure.
rm -rf "$work"
mkdir -p "$work"
prefix=$work/prefix example_build=$work/build
# Nothing from the developer's own plugin directories may take part.
export XDG_DATA_HOME=$work/xdg
unset FULGUR_PLUGIN_PATH

cmake --install "$build_dir" --prefix "$prefix" >"$work/install.log" ||
  fail "cmake --install failed (is the whole project built?); see $work/install.log"
for f in bin/fulgur include/fulgur/plugin.h include/fulgur/registry/registry.h include/fulgur/config.h \
  lib/libfulgur_sdk.so lib/libfulgur_registry.so lib/libfulgur_core.so lib/libfulgur_data.so \
  lib/libfulgur_metrics.so lib/libfulgur_cli.so include/fulgur/data.h include/fulgur/metrics.h include/fulgur/cli.h lib/fulgur/plugins/libfulgur-accelerator-cpu.so \
  lib/cmake/Fulgur/FulgurConfig.cmake lib/cmake/Fulgur/FulgurTargets.cmake lib/cmake/Fulgur/FulgurPlugin.cmake; do
  [ -e "$prefix/$f" ] || fail "not installed: $f"
done
# The package must not point back into the build tree or at this machine's libtorch files (the
# consumer's own find_package(Torch) provides them).
torch_root=${torch_prefix%/share/cmake}
if grep -rlF -e "$build_dir" -e "$torch_root/lib" "$prefix/lib/cmake/Fulgur"; then
  fail "the installed CMake package refers to the build tree or to absolute libtorch paths"
fi
echo "ok: installed into $prefix"

example=$source_dir/examples/third_party_plugin
[ "$(grep -c '^#include' "$example/divergence_guard.cpp")" -eq 1 ] || fail "the example must need one include"
[ "$(wc -l <"$example/divergence_guard.cpp")" -lt 60 ] || fail "the example must stay under 60 lines"

cmake_args=(-S "$example" -B "$example_build" -G "$generator" -DCMAKE_BUILD_TYPE=RelWithDebInfo
  "-DCMAKE_PREFIX_PATH=$prefix;$torch_prefix")
[ -n "$launcher" ] && cmake_args+=("-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher")
cmake "${cmake_args[@]}" >"$work/configure.log" 2>&1 || fail "configuring the example failed; see $work/configure.log"
cmake --build "$example_build" -j 2 >"$work/build.log" 2>&1 || fail "building the example failed; see $work/build.log"
plugin=$example_build/libfulgur-divergence_guard.so
[ -f "$plugin" ] || fail "the example did not produce $plugin"
echo "ok: built $plugin against the installed SDK"
# The example's own test: the installed testing kit (FakeTrainer, conformance checks).
expect_output "the example's test passes with the installed testing kit" "ok: conformance" \
  env FULGUR_LOG_LEVEL=warn "$example_build/divergence_guard_test"

fulgur=$prefix/bin/fulgur
# The TOML's [plugins] paths = ["build"] is relative to the TOML: next to the example build.
toml=$work/divergence_guard.toml
cp "$example/divergence_guard.toml" "$toml"

expect_output "installed fulgur finds its installed built-ins" \
  "$prefix/lib/fulgur/plugins/libfulgur-accelerator-cpu.so" "$fulgur" plugins list
expect_output "describe by name through FULGUR_PLUGIN_PATH" "callback 'divergence_guard' 1.0.0" \
  env FULGUR_PLUGIN_PATH="$example_build" "$fulgur" plugins describe divergence_guard --kind callback
out=$("$fulgur" plugins describe divergence_guard --config "$toml")
for needle in "status: available" "file:   $plugin" "monitor" "\"train_loss\"" "limit" "(required)"; do
  grep -qF -- "$needle" <<<"$out" || fail "describe through [plugins] paths lacks '$needle':"$'\n'"$out"
done
echo "ok: describe through [plugins] paths"

expect_error "plugins load without a config names the required option" "needs option 'limit' (float)" \
  env FULGUR_PLUGIN_PATH="$example_build" "$fulgur" plugins load divergence_guard
expect_output "config check validates the plugin's table" \
  'divergence_guard     limit = 10, monitor = "val_loss"' "$fulgur" config check "$toml"
expect_output "plugins load creates it with the configured options" \
  "created callback 'divergence_guard' from $plugin (limit = 10, monitor = \"val_loss\")" \
  "$fulgur" plugins load divergence_guard --config "$toml"

sed 's/^limit = 10$/limt = 10/' "$toml" >"$work/typo.toml"
expect_error "a misspelled option is named with file:line:col and a suggestion" \
  "$work/typo.toml:12:8: unknown key 'limt' for callback 'divergence_guard'; did you mean 'limit'?" \
  "$fulgur" config check "$work/typo.toml"
sed 's/^limit = 10$/limit = "high"/' "$toml" >"$work/type.toml"
expect_error "an option of the wrong type names expected and found" "'limit' must be float, found string" \
  "$fulgur" config check "$work/type.toml"
sed 's/^limit = 10$/limit = -1/' "$toml" >"$work/refused.toml"
expect_error "the plugin's own refusal comes back as text" \
  "callback 'divergence_guard' from $plugin failed to initialise: divergence_guard: limit must be positive" \
  "$fulgur" plugins load divergence_guard --config "$work/refused.toml"

# A model plugin links the engine only; the datamodule beside it links the data library.
needed() { readelf -d "$1" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
model_needs=$(needed "$example_build/libfulgur-line_model.so")
grep -qx 'libfulgur_core.so.*' <<<"$model_needs" || fail "line_model does not link libfulgur_core:"$'\n'"$model_needs"
if grep -qE '^libfulgur_(data|metrics|cli)\.so' <<<"$model_needs"; then
  fail "the model plugin links more than the engine:"$'\n'"$model_needs"
fi
grep -qx 'libfulgur_data.so.*' <<<"$(needed "$example_build/libfulgur-line_data.so")" ||
  fail "line_data does not link libfulgur_data"
echo "ok: the model plugin links the engine only (libfulgur_core), its datamodule the data library"
# Of libtorch, a plugin built with fulgur_add_plugin links what the built-ins link: its CPU half.
# Linking libtorch_cuda (and through it cuBLAS, cuDNN, NCCL, ...) made every CPU process that loads
# the plugin pay ~0.4 s and ~34 k page faults more at start (issue #42, item 11).
torch_needs() { needed "$1" | grep -E '^lib(torch|c10|cud|nccl|cublas|cufft|curand|cusparse|cusolver|nvrtc|nvToolsExt)' | sort; }
builtin_torch=$(torch_needs "$prefix/lib/fulgur/plugins/libfulgur-callback-early_stopping.so")
for so in divergence_guard line_model line_data; do
  plugin_torch=$(torch_needs "$example_build/libfulgur-$so.so")
  [ "$plugin_torch" = "$builtin_torch" ] ||
    fail "libfulgur-$so.so links other libtorch libraries than the built-ins:"$'\n'"$plugin_torch"$'\n'"built-ins:"$'\n'"$builtin_torch"
done
echo "ok: out-of-tree plugins link libtorch's CPU half, as the built-ins: $(echo $builtin_torch)"

# The out-of-tree model and datamodule plugins train through the installed `fulgur fit`.
line_toml=$work/line_model.toml
cp "$example/line_model.toml" "$line_toml"
expect_output "plugins list shows the out-of-tree model plugin" "model        line_model" \
  "$fulgur" plugins list --config "$line_toml"
expect_output "fulgur fit trains the out-of-tree model plugin" "config: $work/line_runs/" \
  "$fulgur" fit --config "$line_toml"
ckpt=$(find "$work/line_runs" -name last.ckpt | head -n 1)
[ -n "$ckpt" ] || fail "fulgur fit left no last.ckpt under $work/line_runs"
out=$("$fulgur" validate --config "$line_toml" --ckpt_path="$ckpt" 2>&1) || fail "fulgur validate failed:"$'\n'"$out"
loss=$(awk '$1 == "val/loss" { print $2 }' <<<"$out")
[ -n "$loss" ] || fail "fulgur validate printed no val/loss:"$'\n'"$out"
awk -v l="$loss" 'BEGIN { exit !(l < 0.01) }' || fail "the line was not learned: val/loss $loss"
echo "ok: fulgur fit + validate of an out-of-tree model plugin (val/loss $loss)"

# An out-of-tree storage plugin (SDK 1.5): the installed kit's conformance check, then the installed
# `fulgur fit` keeping its checkpoints on mirror:// URLs configured by [storage], and resuming.
expect_output "the storage plugin passes the installed kit's conformance check" "ok: storage conformance" \
  env FULGUR_LOG_LEVEL=warn "$example_build/mirror_storage_test"
mirror_toml=$work/mirror.toml
sed -e 's/^max_epochs = 40$/max_epochs = 2/' -e 's/^default_root_dir = .*/default_root_dir = "mirror_runs"/' \
  "$example/line_model.toml" >"$mirror_toml"
printf 'dirpath = "mirror://bucket/line"\n\n[storage]\nname = "mirror"\nroot = "store"\n' >>"$mirror_toml"
expect_output "plugins list shows the storage plugin" "storage      mirror" "$fulgur" plugins list --config "$mirror_toml"
"$fulgur" fit --config "$mirror_toml" >"$work/mirror-fit.log" 2>&1 || fail "fit to mirror:// failed; see $work/mirror-fit.log"
[ -f "$work/store/bucket/line/last.ckpt" ] || fail "no last.ckpt under $work/store/bucket/line"
expect_output "fit resumes from a mirror:// checkpoint" "Restored training state from mirror://bucket/line/last.ckpt" \
  env FULGUR_LOG_LEVEL=info "$fulgur" fit --config "$mirror_toml" --trainer.max_epochs=3 \
  --trainer.ckpt_path=mirror://bucket/line/last.ckpt
echo "ok: fulgur fit keeps checkpoints on an out-of-tree storage plugin and resumes from them"
echo "PASS"
