# Sourced by the other scripts: where the shared virtual environment and the build live.
# FULGUR_VENV overrides the venv location (default: ~/.cache/fulgur/venv, shared by all clones).
: "${FULGUR_VENV:=${XDG_CACHE_HOME:-$HOME/.cache}/fulgur/venv}"
: "${FULGUR_BUILD_DIR:=build}"
: "${CCACHE_DIR:=${XDG_CACHE_HOME:-$HOME/.cache}/fulgur/ccache}"
export FULGUR_VENV FULGUR_BUILD_DIR CCACHE_DIR
# ccache must see through the precompiled header (see libtorch-notes: PCH + ccache).
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# Paths relative to the clone in ccache's hashes, so a second clone (or CI's fresh one) hits the
# same cache entries.
export CCACHE_BASEDIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CCACHE_NOHASHDIR=1
