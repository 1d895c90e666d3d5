#!/usr/bin/env bash
# Install what the real-browser test (tests/ui) needs: Chromium from Debian packages, and JupyterLab +
# Playwright (python) into the project venv. Playwright is never asked to download a browser: the test
# launches /usr/bin/chromium. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ART_NB_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  echo "no $VENV: run scripts/setup.sh first" >&2
  exit 1
fi
if [ ! -x /usr/bin/chromium ]; then
  SUDO=""
  if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi
stamp="$VENV/.art_nb-ui-$(sha256sum scripts/ui_deps.sh | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  # PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD: the pip package alone downloads nothing, this just makes sure.
  PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 "$VENV/bin/pip" install -q "jupyterlab>=4,<5" "playwright>=1.40" \
    "ipywidgets>=7.7,<9" "matplotlib>=3.7" "nbformat>=5.9" "ipykernel>=6.29"
  touch "$stamp"
fi
echo "UI test dependencies ready: /usr/bin/chromium, $("$VENV/bin/python" -c 'import jupyterlab, playwright; print("jupyterlab", jupyterlab.__version__)')"
