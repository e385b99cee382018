#!/usr/bin/env bash
# On a machine with one CUDA GPU, offline, in about 5 minutes (an H200):
#   1. the model against transformers on CUDA, fp32 and bf16, and attention on a fused kernel
#      in bf16 (tests/test_cuda.py);
#   2. step 3 with the smollm-360m shape in bf16, without and with --compile, on the embedded
#      TinyTales data and tokenizer: tokens/s and MFU of the last steps.
# Prints a summary; exits 1 if something failed, 2 if there is no CUDA GPU.
#
#   bash tools/gpu_check.sh            # STEPS=30 SEQ_LEN=1024 MICRO_BATCH=16 to change the run
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
STEPS=${STEPS:-30}
SEQ_LEN=${SEQ_LEN:-1024}
MICRO_BATCH=${MICRO_BATCH:-16}
OUT=${OUT:-$(mktemp -d)}

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False): nothing measured" >&2
    exit 2
fi
python -c "import torch; print('gpu_check:', torch.cuda.get_device_name(0), '| torch',
torch.__version__, '| CUDA', torch.version.cuda)"
summary=()
failed=0

# 1. Parity and the fused attention kernel.
if python -m pytest tests/test_cuda.py -q -rs >"$OUT/parity.log" 2>&1; then
    summary+=("parity fp32 + bf16, fused SDPA kernel in bf16: passed")
else
    summary+=("parity / fused kernel: FAILED (see $OUT/parity.log)")
    failed=1
fi
tail -n 3 "$OUT/parity.log"

# 2. Step 3 with the smollm-360m shape: the median tokens/s and MFU of the second half of the
#    steps (the first ones include compilation and allocator warm-up).
run_step3() {
    local name=$1
    shift
    local log="$OUT/$name.jsonl"
    if ! timeout 240 python step3_dataloader/train.py --model_name smollm-360m --dtype bfloat16 \
        --seq_len "$SEQ_LEN" --micro_batch_size "$MICRO_BATCH" --max_steps "$STEPS" \
        --eval_every 0 --eval_steps 2 --sample_tokens 20 --num_proc 4 --log_file "$log" "$@" \
        >"$OUT/$name.out" 2>&1; then
        summary+=("step 3 smollm-360m bf16 $name: FAILED (see $OUT/$name.out)")
        failed=1
        tail -n 5 "$OUT/$name.out"
        return
    fi
    local result
    result=$(python - "$log" "$OUT/$name.out" <<'EOF'
import json, re, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1])]
late = records[len(records) // 2:]
tokens = statistics.median(r["tokens_per_second"] for r in late)
mfus = [float(m) for m in re.findall(r"mfu ([0-9.]+)%", open(sys.argv[2]).read())]
mfu = f"{statistics.median(mfus[len(mfus) // 2:]):.1f}%" if mfus else "n/a (unknown GPU peak)"
print(f"{tokens:,.0f} tok/s, MFU {mfu}, final loss {records[-1]['loss']:.3f}")
EOF
)
    summary+=("step 3 smollm-360m bf16 $name ($STEPS steps, $MICRO_BATCH x $SEQ_LEN): $result")
}
run_step3 eager
run_step3 compiled --compile

echo
echo "gpu_check summary (logs in $OUT):"
for line in "${summary[@]}"; do
    echo "  $line"
done
exit $failed
