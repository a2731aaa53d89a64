# One device call's worth of issues 66 and 67 on the lent GPU machine (from the repository root; carry
# [".whl", ".ray"]): issue 66's finetune tables (scripts/gpu-finetune.sh), then its `fit --target seq_len`
# through Ray (experiments/llama_1b_lora_seq_fit.yaml), then issue 67's profile in the seconds left of
# CALL_S. Each part has its own limit, so a slow one leaves the others their time.
#   bash scripts/gpu-session.sh      FT_TIMEOUT=210 FIT_S=200 CALL_S=560 (the defaults)
set -u
source scripts/gpu-env.sh
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E 'H100|H200' | tr A-Z a-z)
T0=$(date +%s)
python3 -c "import torch, transformers, timm, deepspeed, peft, ray
print('versions:', torch.__version__, transformers.__version__, timm.__version__, deepspeed.__version__,
      peft.__version__, ray.__version__)"
DIR=results/finetune-$G TIMEOUT=${FT_TIMEOUT:-210} bash scripts/gpu-finetune.sh
echo "session: finetune done at $(( $(date +%s) - T0 )) s"
timeout "${FIT_S:-200}" python3 -m ray_zero fit experiments/llama_1b_lora_seq_fit.yaml --target seq_len \
  --budget-gib 24 --output "$OUT/fit-seq-$G" 2>&1 | grep -v "^(" | tail -25
echo "session: fit done at $(( $(date +%s) - T0 )) s"
LEFT=$(( ${CALL_S:-560} - ($(date +%s) - T0) ))
if [ "$LEFT" -gt 60 ]; then
  timeout "$LEFT" python3 -m ray_zero profile --budget-s $(( LEFT - 30 )) --output "$OUT/$G.json" 2>&1 | tail -5
fi
echo "session: done at $(( $(date +%s) - T0 )) s"
