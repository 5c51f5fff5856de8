#!/usr/bin/env bash
# Builds the documentation site into $FULGUR_BUILD_DIR/docs (default build/docs; open index.html):
#   1. builds what the reference pages are made from (the `fulgur` command and the built-in plugins),
#      unless --no-build (the docs test runs it on the build it tests);
#   2. checks the SDK's API comments: Doxygen over sdk/include with WARN_IF_UNDOCUMENTED and
#      WARN_AS_ERROR (Doxyfile), so a public SDK declaration without its `///` fails here;
#   3. copies docs/ to a staging folder and adds what is generated, so nothing generated is checked
#      in and nothing can drift: one page per built-in plugin from `fulgur plugins describe --all
#      --json`, and the C++ API reference (SDK, core, data, metrics and cli headers) from Doxygen;
#   4. `mkdocs build --strict` (Material theme): any warning, such as a link to a missing page, file
#      or anchor, or a page left out of the navigation, fails the build.
# MkDocs and the theme are pinned in scripts/requirements.txt and doxygen is in setup.sh's list.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
build=1
for a in "$@"; do
  case "$a" in
    --no-build) build=0 ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "docs.sh: unknown argument $a (use --no-build)" >&2; exit 2 ;;
  esac
done
if ((build)); then "$here/build.sh"; else "$here/setup.sh"; fi
cd "$here/.."
build_dir="$(cd "$FULGUR_BUILD_DIR" && pwd)"
fulgur="$build_dir/bin/fulgur"
plugin_dir="$build_dir/lib/fulgur/plugins"
[ -x "$fulgur" ] || { echo "docs.sh: $fulgur is missing: build first (scripts/build.sh)" >&2; exit 1; }

staging="$build_dir/docs-src"
rm -rf "$staging"
mkdir -p "$staging"
cp -r docs "$staging/docs"

echo "docs: checking the SDK's /// comments (doxygen, warnings are errors)"
(cat Doxyfile; echo "OUTPUT_DIRECTORY = $build_dir/doxygen") | doxygen -

echo "docs: C++ API reference (doxygen)"
api_inputs="sdk/include/fulgur core/include/fulgur data/include/fulgur metrics/include/fulgur cli/include/fulgur"
# The application headers (core, data, metrics, cli) are not all documented member by member yet:
# only the SDK's are required to be (step above), so here undocumented members are not warnings;
# every other warning still fails.
(cat Doxyfile
  echo "PROJECT_NAME = \"Fulgur C++ API\""
  echo "PROJECT_BRIEF = \"The plugin SDK, the Trainer and Module, data, metrics, weights and the command line\""
  echo "INPUT = $api_inputs"
  echo "RECURSIVE = YES"
  echo "EXCLUDE_PATTERNS = */detail/*"
  echo "STRIP_FROM_PATH = sdk/include core/include data/include metrics/include cli/include"
  echo "STRIP_FROM_INC_PATH = sdk/include core/include data/include metrics/include cli/include"
  echo "WARN_IF_UNDOCUMENTED = NO"
  echo "OUTPUT_DIRECTORY = $staging/docs/reference"
  echo "HTML_OUTPUT = api") | doxygen -

echo "docs: plugin reference pages (fulgur plugins describe --all --json)"
FULGUR_PLUGIN_PATH="" "$FULGUR_VENV/bin/python" "$here/docs_plugins.py" --fulgur "$fulgur" --plugin-dir "$plugin_dir" \
  --config mkdocs.yml --staging "$staging" --site "$build_dir/docs"

echo "docs: mkdocs build --strict"
# NO_MKDOCS_2_WARNING: the theme prints a banner about its successor on every build; it is not a
# warning about these docs.
export NO_MKDOCS_2_WARNING=1
# Not --quiet: it hides the warnings from the count that --strict fails on.
"$FULGUR_VENV/bin/mkdocs" build --strict -f "$staging/mkdocs.yml"
echo "docs: site in $build_dir/docs/index.html"
