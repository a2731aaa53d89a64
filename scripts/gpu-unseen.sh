# Families no zoo experiment names, on the lent GPU machine, with calibration off: every row's peak
# predicted from its traced step alone (issue 52), each family in scripts/zoo.py (one rank, no Ray), bf16,
# DeepSpeed ZeRO-1, DDP + ZeRO-1 and FSDP2 stage 3. One tarball of result folders in $OUT.
#   bash scripts/gpu-unseen.sh [FAMILY ...]      # FAMILY: a name below (default: all), within BUDGET s
set -u
source scripts/gpu-env.sh
declare -A MODEL CONFIG SEQ MB
MODEL[qwen2]=hf:qwen2;  CONFIG[qwen2]='{hidden_size: 896, num_hidden_layers: 12, num_attention_heads: 14, num_key_value_heads: 2, intermediate_size: 4864, vocab_size: 32000}'; SEQ[qwen2]=1024; MB[qwen2]=4
MODEL[roberta]=hf:roberta; CONFIG[roberta]='{}'; SEQ[roberta]=510; MB[roberta]=16
MODEL[opt]=hf:opt; CONFIG[opt]='{hidden_size: 768, num_hidden_layers: 12, ffn_dim: 3072, num_attention_heads: 12}'; SEQ[opt]=1024; MB[opt]=8
MODEL[gemma]=hf:gemma; CONFIG[gemma]='{hidden_size: 1024, num_hidden_layers: 8, num_attention_heads: 8, num_key_value_heads: 1, intermediate_size: 4096, head_dim: 128, vocab_size: 32000}'; SEQ[gemma]=1024; MB[gemma]=4
MODEL[deit]=timm:deit_small_patch16_224; CONFIG[deit]='{}'; SEQ[deit]=null; MB[deit]=128
MODEL[efficientnet]=timm:efficientnet_b0; CONFIG[efficientnet]='{}'; SEQ[efficientnet]=null; MB[efficientnet]=96
MODEL[bart]=hf:bart; CONFIG[bart]='{}'; SEQ[bart]=512; MB[bart]=8
MODEL[mobilenet]=timm:mobilenetv3_large_100; CONFIG[mobilenet]='{}'; SEQ[mobilenet]=null; MB[mobilenet]=128
FAMILIES=("$@")
[ ${#FAMILIES[@]} -eq 0 ] && FAMILIES=(qwen2 roberta deit opt efficientnet gemma bart mobilenet)
R=$(mktemp -d /tmp/unseen.XXXX)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
started=$(date +%s)
for f in "${FAMILIES[@]}"; do
  left=$(( ${BUDGET:-300} - $(date +%s) + started ))
  [ $left -lt 40 ] && { echo "unseen: $f not run, ${left} s left"; continue; }
  timeout $left python3 scripts/zoo.py experiments/zoo_bert_base.yaml --precision bf16 --output $R/$f \
    --set "model=${MODEL[$f]}" --set "model_config=${CONFIG[$f]}" --set "seq_len=${SEQ[$f]}" \
    --set "grid.micro_batch_size=[${MB[$f]}]" --set calibrate=false --set "name=unseen_$f" \
    2>&1 | grep -E "^zoo:|Error|error" | cut -c1-240 | tee -a $R/unseen.log
done
cd $R && tar czf $OUT/unseen.tgz . ; echo "unseen: tarball $(du -h $OUT/unseen.tgz | cut -f1)"
