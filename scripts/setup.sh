#!/usr/bin/env bash
# Installs everything Fulgur needs on a fresh Debian machine, and nothing twice:
#   - Debian packages (only the missing ones; apt-get update only when something is missing),
#   - a Python virtual environment outside the clone holding the pinned torch wheel, whose
#     libtorch is what the C++ build links (reused by every clone and every CI run).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"

# nlohmann-json3-dev: the JSON header of .safetensors files (fulgur/weights.h) is parsed with it
# rather than by hand: header-only, well kept in Debian, and strict about malformed input.
# libjpeg62-turbo-dev, libpng-dev: the image-folder reader (fulgur/data/image_folder.h) decodes
# JPEG with libjpeg-turbo (SIMD, the decoder Pillow and torchvision use, security-maintained in
# Debian) and PNG with libpng's simplified API (handles every colour type and bit depth).
# libcurl4-openssl-dev: the mlflow logger's HTTP client (timeouts, keep-alive, HTTPS and proxies
# for a remote tracking server; a C API with one small header, so no compile-time cost).
# fortunes: the text corpus of the GPT example (examples/gpt): 2.6 MB of plain English in
# /usr/share/games/fortunes, read as it is (bible-kjv-text stores its text in a compressed format
# only its own program reads; jargon-text's one file sits in /usr/share/doc, which slim images drop).
# abigail-tools: abidw/abidiff (libabigail), which compare the SDK's ABI with the stored 1.0 baseline
# (tests/abi/abi_check.sh, scripts/abi_check.sh).
# doxygen: the SDK's API reference in the docs site (scripts/docs.sh), and the docs test's check
# that every public SDK declaration has its `///` comment (Doxyfile: WARN_IF_UNDOCUMENTED).
apt_packages=(build-essential cmake ninja-build ccache libboost-dev libgloo-dev libtomlplusplus-dev
  libspdlog-dev libfmt-dev doctest-dev zlib1g-dev dataset-fashion-mnist python3-venv binutils file
  nlohmann-json3-dev libjpeg62-turbo-dev libpng-dev libcurl4-openssl-dev fortunes abigail-tools doxygen)
missing=()
for p in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "fulgur setup: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# The venv is keyed by nothing but its location; the stamp records what was installed into it.
stamp="$FULGUR_VENV/.fulgur-requirements"
if [ ! -x "$FULGUR_VENV/bin/python" ]; then
  echo "fulgur setup: creating virtual environment $FULGUR_VENV"
  mkdir -p "$(dirname "$FULGUR_VENV")"
  python3 -m venv "$FULGUR_VENV"
fi
if ! cmp -s "$here/requirements.txt" "$stamp"; then
  echo "fulgur setup: installing $(grep -v '^#' "$here/requirements.txt" | xargs) into $FULGUR_VENV"
  "$FULGUR_VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt"
  cp "$here/requirements.txt" "$stamp"
fi
