#!/bin/bash
# What the lead runs on the H200 (device tool) for tests/gpu, after the parts are stashed there
# (../shared/gpu/README.md). Runs a committed snapshot (`git archive HEAD > gpu_snapshot.tar` and
# `git rev-parse HEAD > gpu_snapshot.commit`, both git-ignored, named in the device call's carry) so the
# code tested is exactly one commit; logs and JSON go to $OUT.
#   bash tests/gpu/run_on_h200.sh [pytest args...]
set -uo pipefail
ROOT=$(pwd)
bash .gpu/bin/unpack.sh >/dev/null && source .gpu/bin/env.sh
bash tests/gpu/install_extra.sh  # what the staged packages lack, carried in .gpu/extra/
SNAP=/root/snap && rm -rf "$SNAP" && mkdir -p "$SNAP" && tar -xf gpu_snapshot.tar -C "$SNAP"
cd "$SNAP"
{ date -u; nvidia-smi; python3 -c "import torch, transformers, peft, vllm, unsloth, trl, bitsandbytes as b, sys; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', \
peft.__version__, 'vllm', vllm.__version__, 'unsloth', unsloth.__version__, 'trl', trl.__version__, 'bitsandbytes', b.__version__)"; \
  cat "$ROOT/gpu_snapshot.commit"; } > "$OUT/env.txt" 2>&1
# Two processes: vLLM starts one engine per process (its CuMem allocator), and test_qwen25_gpu.py serves
# another model than the rest. Each writes its own results file and log.
START=$(date +%s)
ART_NB_GPU_RESULTS=$OUT timeout -s INT -k 10 "${GPU_TESTS_S:-540}" python3 -m pytest -q -p no:cacheprovider -rA \
  -k "not qwen25" "$@" tests/gpu 2>&1 | grep --line-buffered -v "DEBUG" > "$OUT/gpu_tests.log"
tail -12 "$OUT/gpu_tests.log"
[ "${QWEN25_S:-240}" = 0 ] && exit 0  # QWEN25_S=0: the first process only
LEFT=$(( ${GPU_TESTS_S:-540} + ${QWEN25_S:-240} - ($(date +%s) - START) ))
ART_NB_GPU_RESULTS=$OUT/qwen25 timeout -s INT -k 10 "$LEFT" python3 -m pytest -q -p no:cacheprovider -rA \
  -k qwen25 "$@" tests/gpu 2>&1 | grep --line-buffered -v "DEBUG" > "$OUT/gpu_tests_qwen25.log"
tail -12 "$OUT/gpu_tests_qwen25.log"
