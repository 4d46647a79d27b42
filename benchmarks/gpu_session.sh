#!/usr/bin/env bash
# Every GPU check of the project in one call, for a GPU machine lent for minutes: the Qwen3-VL 2B / 8B benchmark
# (issue 33 item 1), the demo's data wait on the GPU (item 4), then the gpu-marked tests, each under its own time
# limit so that one slow part leaves the others' results. Logs go to $OUT (default /tmp/gpu_session).
#
#   bash benchmarks/gpu_session.sh                    # ~7 minutes on one H200 (2026-11-26)
#   PARTS="bench-2b compile" bash benchmarks/gpu_session.sh   # only these parts: bench (= bench-2b bench-8b),
#                                                            # compile, varlen, budget, profile, variants, liger,
#                                                            # table-2b, table-8b (issue 44's contenders), grpo,
#                                                            # demo, tests
#
# compile: 2B vlmtrain padded with and without torch.compile (30 steps, lengths rounded to 64), recompiles
# counted. varlen: the 2B benchmark with the vision attention in one call, and vlmtrain packed's text attention
# as model.attn_implementation varlen_torch (per document, no dense mask). profile: one eager vlmtrain step's top
# operators. variants: the 2B setup with torch.compile, and without activation checkpointing (8 steps each, every
# contender; transformers compiles the whole model: ~150 s). liger: the 2B benchmark with transformers' Trainer with
# and without use_liger_kernel and vlmtrain padded / packed with train.use_liger_kernel (needs the liger-kernel
# wheel in .whl/: pip download --no-deps liger-kernel -d .whl).
# grpo: GRPO on Qwen3-VL-2B LoRA (random init, bf16), TRL's GRPOTrainer against vlmtrain's, each in its own process
# (benchmarks/grpo.py: 4 prompts x 8 completions of up to 128 tokens, one 448 px image per prompt, 5 steps, 3 timed,
# one round), log $OUT/grpo-2b-lora.log; limit GRPO_S (200 s). Not measured yet: an estimate of ~2-3 minutes
# (two processes' start and model init, then token-by-token generation), so it is not in the default PARTS (with
# it the default would pass ~9 minutes): PARTS=grpo runs it alone. GRPO_ARGS replaces those sizes (GRPO_ARGS=--smoke:
# the same code path on tiny dims, seconds on CPU).
#
# Packages missing on the machine can come as wheels in .whl/ (installed with --target, ahead of the machine's).
set -u
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
PY=${PYTHON:-python3}
start=$SECONDS
step() {  # step NAME LIMIT_S COMMAND...: run under a time limit, log to $OUT/NAME.log, say how it ended
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s, at $((SECONDS - start))s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL:-40}" "$OUT/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - start))s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

PARTS=${PARTS:-bench demo tests}
want() { [[ " $PARTS " == *" $1 "* ]]; }
if want bench || want bench-2b; then  # (~150 s on an H200)
    TAIL=12 step bench-2b-full "${BENCH_2B_S:-170}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 12 \
        --warmup 4 --progress
fi
if want bench || want bench-8b; then  # (~110 s)
    TAIL=12 step bench-8b-lora "${BENCH_8B_S:-170}" $PY benchmarks/gpu_hub_vlm.py --only 8b-lora --steps 8 \
        --warmup 3 --progress
fi
if want compile; then  # vlmtrain padded, eager then regional torch.compile, lengths rounded to 64 (bounded shapes),
    # 30 steps so that compiling is over before the timed steps; recompiles counted (~4 minutes on an H200)
    for mode in no-torch-compile torch-compile; do
        TAIL=6 TORCH_LOGS=recompiles step "compile-2b-$mode" "${COMPILE_2B_S:-150}" $PY benchmarks/gpu_hub_vlm.py \
            --only 2b-full --steps 30 --warmup 15 --progress --$mode --pad-to-multiple-of 64 \
            --contender "vlmtrain padded"
        grep -c "Recompiling function" "$OUT/compile-2b-$mode.log"
    done
fi
if want varlen; then  # vision attention in one varlen call (every contender), packed text varlen_torch (~150 s)
    TAIL=12 step varlen-2b "${VARLEN_2B_S:-170}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 12 \
        --warmup 4 --progress --vision-attn varlen --text-attn varlen
fi
if want budget; then  # token-budget micro-batches (one row of 16,384 tokens a step, vision padded, varlen_torch)
    # against transformers, 2B then 8B (~4 minutes on an H200, not measured yet)
    TAIL=10 step budget-2b "${BUDGET_S:-200}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 12 --warmup 4 \
        --progress --contender transformers --contender "vlmtrain budget"
    TAIL=10 step budget-8b "${BUDGET_S:-200}" $PY benchmarks/gpu_hub_vlm.py --only 8b-lora --steps 10 --warmup 3 \
        --progress --contender transformers --contender "vlmtrain budget"
fi
if want profile; then  # where one eager vlmtrain step spends its time (torch.profiler; steps 5-7 left out)
    TAIL=60 step profile-2b "${PROFILE_S:-120}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 9 \
        --warmup 4 --progress --profile "vlmtrain padded" --contender "vlmtrain padded"
fi
if want variants; then  # (the full-bench variants: every contender with torch.compile, none with checkpointing)
    TAIL=10 step bench-2b-compile "${VARIANT_S:-200}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 8 \
        --warmup 4 --progress --torch-compile
    TAIL=10 step bench-2b-no-ac "${VARIANT_S:-200}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 8 \
        --warmup 3 --progress --no-activation-checkpointing
fi
if want liger; then  # transformers, transformers + liger, vlmtrain padded / packed with Liger (7 steps, 4 timed)
    TAIL=14 step liger-2b "${LIGER_2B_S:-170}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps 7 --warmup 3 \
        --progress --liger
fi
if want table-2b; then  # issue 44's table at 2B: transformers, transformers + liger, vlmtrain padded, vlmtrain budget
    TAIL=14 step table-2b "${TABLE_2B_S:-200}" $PY benchmarks/gpu_hub_vlm.py --only 2b-full --steps "${TABLE_STEPS:-18}" \
        --warmup 4 --progress --contender transformers --contender "transformers + liger" \
        --contender "vlmtrain padded" --contender "vlmtrain budget" ${TABLE_ARGS:-}
fi
if want table-8b; then  # the same at 8B LoRA
    TAIL=14 step table-8b "${TABLE_8B_S:-200}" $PY benchmarks/gpu_hub_vlm.py --only 8b-lora --steps "${TABLE_STEPS:-18}" \
        --warmup 4 --progress --contender transformers --contender "transformers + liger" \
        --contender "vlmtrain padded" --contender "vlmtrain budget" ${TABLE_ARGS:-}
fi
if want grpo; then  # GRPO Qwen3-VL-2B LoRA, TRL vs vlmtrain (estimated 2-3 minutes on an H200, not measured yet)
    TAIL=12 step grpo-2b-lora "${GRPO_S:-200}" $PY benchmarks/grpo.py --model qwen3_vl_2b --lora \
        ${GRPO_ARGS:---steps 5 --warmup 2 --rounds 1 --prompts 4 --generations 8 --length 128 --image-size 448}
fi
want demo && step demo "${DEMO_S:-130}" $PY -m vlmtrain demo --output-dir /tmp/gpu_session_demo
cp /tmp/gpu_session_demo/metrics.jsonl "$OUT/demo-metrics.jsonl" 2>/dev/null
want demo && $PY - <<'EOF'
import json, os
path = "/tmp/gpu_session_demo/metrics.jsonl"
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
waits = [(r["step"], r["data_wait_fraction"], r.get("samples_per_second")) for r in rows if "data_wait_fraction" in r]
print("demo data_wait_fraction per logging window (step, fraction, samples/s):", waits[:3], "...", waits[-3:])
if waits:
    print(f"demo data wait: mean {sum(w[1] for w in waits) / len(waits):.4f}, max {max(w[1] for w in waits):.4f} "
          f"over {len(waits)} windows")
print("demo final:", [r for r in rows if "train_runtime" in r][-1:])
EOF
want tests && TAIL=12 step gpu-tests "${TESTS_S:-120}" $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
    tests/test_hub_workers.py tests/test_benchmarks_smoke.py tests/test_varlen_attention.py tests/test_liger.py \
    tests/test_vision_attention.py
echo "done after $((SECONDS - start))s"
