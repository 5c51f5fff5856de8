#!/usr/bin/env bash
# Opens the built docs site (scripts/docs.sh) in a real headless browser: screenshots of a few pages
# and a search, for a person to look at. Optional: not part of setup.sh, test.sh or CI; it installs
# its own Debian packages (below) only when run.
#   scripts/docs_browser.sh [OUT_DIR]     (default build/docs-screenshots)
# Writes OUT_DIR/<page>.png for the front page, the "coming from Lightning" page, one plugin
# reference page and the search box asked for "ckpt_path", and fails when a page does not show
# what it should (the search: no result).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/env.sh"
cd "$here/.."
site="$(cd "$FULGUR_BUILD_DIR" && pwd)/docs"
out="${1:-$FULGUR_BUILD_DIR/docs-screenshots}"
[ -f "$site/index.html" ] || { echo "docs_browser.sh: no site in $site: run scripts/docs.sh first" >&2; exit 1; }

# The optional docs dependency list: Debian's Chromium and fonts for its text.
docs_browser_packages=(chromium fonts-dejavu-core)
missing=()
for p in "${docs_browser_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "docs_browser.sh: installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

mkdir -p "$out"
# Material's search loads its index with fetch(), which file:// pages may not do: serve the site on
# the loopback interface, on a free port, for the length of this script.
port="$("$FULGUR_VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')"
"$FULGUR_VENV/bin/python" -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
  "$FULGUR_VENV/bin/python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" 2>/dev/null && break
  sleep 0.1
done

# Each page is shot once what matters is on it (the search results appear only after the search
# index has loaded in a web worker, which a plain `chromium --screenshot` does not wait for), so the
# browser is driven over the DevTools protocol (scripts/docs_browser.py).
"$FULGUR_VENV/bin/python" "$here/docs_browser.py" chromium "http://127.0.0.1:$port/" "$out"
