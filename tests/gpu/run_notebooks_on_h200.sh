#!/bin/bash
# What the lead runs on the H200 (device tool) to execute the notebooks as a Colab user would, after the
# parts are stashed there (../shared/gpu/README.md): on a committed snapshot (gpu_snapshot.tar and
# gpu_snapshot.commit, git-ignored, named in the device call's carry), with tests/gpu/run_notebooks.py.
#   bash tests/gpu/run_notebooks_on_h200.sh tic_tac_toe:a100:12 tic_tac_toe:t4:4 ...
set -uo pipefail
ROOT=$(pwd)
bash .gpu/bin/unpack.sh >/dev/null && source .gpu/bin/env.sh
# The tool-agent notebook's LangGraph and LangChain are not in the staged packages and the machine has no
# network: carry their wheels in .gpu/extra/ (tests/gpu/install_extra.sh says how).
bash tests/gpu/install_extra.sh
SNAP=/root/snap && rm -rf "$SNAP" && mkdir -p "$SNAP" && tar -xf gpu_snapshot.tar -C "$SNAP"
cd "$SNAP"
{ date -u; nvidia-smi -L; cat "$ROOT/gpu_snapshot.commit"; } > "$OUT/notebooks_env.txt" 2>&1
# NB_DEADLINE_S: SIGINT then, so a device call's limit still brings back the cells run so far
timeout -s INT "${NB_DEADLINE_S:-86400}" python3 tests/gpu/run_notebooks.py /root/nbwork "$@" 2>&1 | grep -v DEBUG | tail -40 > "$OUT/notebooks_run.log"
cp /root/nbwork/notebooks_gpu.json "$OUT/" 2>/dev/null
for nb in /root/nbwork/*.executed.ipynb; do [ -f "$nb" ] && cp "$nb" "$OUT/"; done
cat "$OUT/notebooks_run.log"
