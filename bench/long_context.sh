#!/usr/bin/env bash
# Long-context accuracy of a bundle where it is served, for BF16, KIVI-style and OSCAR INT2:
#   1. oscar verify at the longest context (the gate: NLL excess by position bucket, needles, KL, perplexity);
#   2. oscar eval: perplexity with the NLL excess over BF16 by position bucket, needle retrieval (5 depths x 2 keys);
#   3. oscar eval --suite ruler: the RULER-style tasks, SAMPLES prompts per task and length.
# Usage: bash bench/long_context.sh BUNDLE CONTEXTS SAMPLES OUT [DEVICE] [STEPS]
#   e.g. bash bench/long_context.sh zoo/Qwen/Qwen2.5-Coder-0.5B-Instruct/v1 4096,16384,32768 10 bench/results/long_context/qwen
#   STEPS: any of verify,eval,ruler (default all three). A verify FAIL is a result, not an error: its JSON says why.
set -euo pipefail
bundle=${1:?usage: long_context.sh BUNDLE CONTEXTS SAMPLES OUT [DEVICE] [STEPS]}
contexts=${2:?contexts, e.g. 4096,16384,32768}
samples=${3:?RULER-style prompts per task and length}
out=${4:?output directory}
device=${5:-cuda}
steps=${6:-verify,eval,ruler}
oscar=${OSCAR:-oscar}
mkdir -p "$out"
flags=()
for c in ${contexts//,/ }; do flags+=(--context "$c"); done
longest=${contexts##*,}
if [[ ,$steps, == *,verify,* ]]; then
  $oscar verify "$bundle" --device "$device" --seq-len "$longest" --needles 10 --json "$out/verify.json" || true
fi
if [[ ,$steps, == *,eval,* ]]; then
  $oscar eval "$bundle" --device "$device" "${flags[@]}" --samples 1 --methods bf16,kivi,oscar \
    --depths 0.1,0.3,0.5,0.7,0.9 --needle-trials 2 --json "$out/eval.json" --plot "$out/eval.png"
fi
if [[ ,$steps, == *,ruler,* ]]; then
  $oscar eval "$bundle" --suite ruler --device "$device" "${flags[@]}" --samples "$samples" --methods bf16,kivi,oscar \
    --json "$out/ruler.json" --plot "$out/ruler.png"
fi
