#!/bin/bash
# The GPU benchmarks on an H200, one segment per device call (each ends within ~9 min 20 s; a call may run 10 min).
#
#   bash bench/run_h200.sh SEGMENT      # on the GPU machine, from the repository root, $OUT set
#
# SEGMENT      what runs                                                     expected on an H200
# throughput   gpu_throughput.py --startup fast eager (plain vLLM + art_nb + vLLM's server where time is left)   ~9 min
# step         gpu_step.py (art_nb vs TRL colocated, both vLLM "fast"; 3 interleaved rounds)   ~5 min
# pipeline     gpu_step.py --art-modes sync pipelined (art_nb's loop with and without art.pipeline vs TRL,
#              3 interleaved rounds)                                         ~7 min (register ~100 s)
# curves       gpu_tictactoe.py --pipeline both (SmolLM2 learning curves with and without the pipeline,
#              on the same games)                                            ~3.5 min
# endpoint     gpu_throughput.py --startup fast, then endpoint_per_request.py on this host's CPU (what one request
#              costs the client and the server thread, no engine) and its profile at 256   ~8 min; with
#              H200_PER_REQUEST=0 the throughput with vLLM's own OpenAI server as a third part instead   ~8 min
# t4           gpu_t4_vs_unsloth.py (Unsloth's T4 recipe vs art_nb's T4 config, 15 GiB cap)   ~8-9 min (alone)
# memory       gpu_memory_fit.py (the 2048 notebook's config, 15 GiB cap)    ~6.5 min
# prefix       hf_prefix_cache.py on the GPU (transformers engine, SmolLM2): multi-turn rollouts with the
#              prefix cache off and on                                       ~2 min (estimated)
# startup      gpu_startup.py --modes fast eager: register's phases in a fresh process   ~3 min (estimated)
#
# Unpacks the staged parts first (idempotent: seconds when the machine is still warm) and builds the
# random 3B model once per machine (~10-45 s). Results: $OUT/bench/<benchmark>.json, rewritten after
# every section, so a later part failing or the time running out never loses a finished part; the
# parts' logs under $OUT/bench/_parts/. Ends with one line: the segment, its seconds and the verdict.
set -u
SEGMENT=${1:?usage: bash bench/run_h200.sh throughput|endpoint|step|pipeline|curves|t4|memory|prefix|startup}
START=$(date +%s)
LIMIT=${H200_SEGMENT_S:-560}             # seconds from now until everything must have ended
: "${OUT:?set OUT (the folder that comes back)}"
mkdir -p "$OUT/bench"
PY=${PYTHON:-python3}

if [ -f .gpu/bin/unpack.sh ] && [ -d /root/stash ]; then
  bash .gpu/bin/unpack.sh || echo "unpack.sh failed: going on with what is installed"
fi
[ -f .gpu/bin/env.sh ] && source .gpu/bin/env.sh
# vLLM's quantisation path (Unsloth's fast_inference in `t4`, vLLM serving NF4 in `t4` and `memory`) imports
# compressed_tensors (vLLM 0.25 pins 0.17.0; not in the staged vLLM site): carry .gpu/extra/ with the
# compressed_tensors-0.17.0 and loguru wheels (`pip download compressed-tensors==0.17.0 loguru --no-deps -d .gpu/extra`).
bash tests/gpu/install_extra.sh

left() { echo $(( LIMIT - ($(date +%s) - START) )); }
# Run a benchmark with a deadline of its own (what is left, less a margin) and a hard stop just before
# the segment's limit (SIGINT first, SIGKILL 10 s later): its JSON holds every section finished by then.
bench() {
  local script=$1; shift
  echo "== $script $* (hard stop in $(( $(left) - 12 )) s)"
  timeout -s INT -k 10 $(( $(left) - 12 )) "$PY" "bench/$script" --out "$OUT/bench" "$@"
  echo "== $script ended with $? after $(( $(date +%s) - START )) s"
}
deadline_flag() { echo "--deadline-s $(( $(left) - 25 < $1 ? $(left) - 25 : $1 ))"; }

case "$SEGMENT" in
  throughput) bench gpu_throughput.py --startup fast eager $(deadline_flag 540); FILE=gpu_throughput ;;
  step)       bench gpu_step.py --startup fast $(deadline_flag 520); FILE=gpu_step ;;
  pipeline)   # The step benchmark with art.pipeline as a third side: its gpu_step.json holds all three.
              # H200_STEP_ARGS adds flags (e.g. "--vllm-stream high": vLLM's thread on a stream of its own)
              bench gpu_step.py --startup fast --art-modes sync pipelined $(deadline_flag 540) ${H200_STEP_ARGS:-}
              FILE=gpu_step ;;
  curves)     # SmolLM2 tic-tac-toe trained twice from step 0 on the same games, with and without art.pipeline
              echo "== gpu_tictactoe.py --pipeline both ($(left) s left)"
              timeout -s INT -k 10 $(( $(left) - 12 )) "$PY" bench/gpu_tictactoe.py "$OUT/bench/tictactoe" --steps 12 \
                --pipeline both --cuda-graphs --budget-s $(( $(left) - 110 ))
              echo "== gpu_tictactoe.py ended with $? after $(( $(date +%s) - START )) s"
              # its backend's store (checkpoints, logs) is too many files to come back, and crowded out the JSON
              rm -rf "$OUT/bench/tictactoe/art"
              FILE=tictactoe/tictactoe ;;
  endpoint)   # Where the endpoint's time goes at the engine's side (gpu_throughput's request arrival times) and at
              # the client's and server's (endpoint_per_request.py: the same request path with an engine that answers
              # at once, so its CPU per request is this host's, not this project's 2-core box's).
              # H200_PER_REQUEST=0: the throughput alone, with vLLM's own OpenAI server as the peer (~8 min);
              # otherwise the server part is skipped for time
              bench gpu_throughput.py --startup fast $(deadline_flag $([ "${H200_PER_REQUEST:-1}" = 0 ] && echo 480 || echo 330))
              if [ "${H200_PER_REQUEST:-1}" != 0 ]; then
                echo "== endpoint_per_request.py ($(left) s left)"
                timeout -s INT -k 10 $(( $(left) - 70 )) "$PY" bench/endpoint_per_request.py --kinds plain logprobs \
                  --out "$OUT/bench/endpoint_per_request_h200.json" 2>&1 | tail -20
                timeout -s INT -k 10 $(( $(left) - 12 )) "$PY" bench/endpoint_per_request.py --profile plain:256 \
                  --requests 512 > "$OUT/bench/endpoint_per_request_profile_h200.txt" 2>&1
              fi
              FILE=gpu_throughput ;;
  t4)         # Both sides need ~8 min at 5 steps (measured: Unsloth import 37 s + load 97 s + first step 39 s;
              # art_nb register 62 s + first step 51 s): run it alone with the full limit, or fewer steps
              # (H200_T4_STEPS=3); H200_T4_ARGS adds flags (e.g. "--parts unsloth art_settled": art_nb's variants).
              bench gpu_t4_vs_unsloth.py ${H200_T4_STEPS:+--steps $H200_T4_STEPS} $(deadline_flag 540) ${H200_T4_ARGS:-}
              FILE=gpu_t4_vs_unsloth ;;
  memory)     # H200_MEMORY_ARGS="--vllm-4bit off": vLLM serves bf16 weights beside the 4-bit trainer
              bench gpu_memory_fit.py --startup fast ${H200_MEMORY_ARGS:-}; FILE=gpu_memory_fit ;;
  prefix)     bench hf_prefix_cache.py --out "$OUT/bench/hf_prefix_cache_h200.json"; FILE=hf_prefix_cache_h200 ;;
  startup)    bench gpu_startup.py --modes fast eager; FILE=gpu_startup ;;
  *) echo "unknown segment $SEGMENT: throughput, endpoint, step, pipeline, curves, t4, memory, prefix or startup"; exit 2 ;;
esac

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/bench/${FILE}.gpu.txt" 2>&1
echo "h200 $SEGMENT: $(( $(date +%s) - START )) s; $("$PY" bench/make_table.py --one-line "$OUT/bench/$FILE.json" 2>&1 | tail -1)"
