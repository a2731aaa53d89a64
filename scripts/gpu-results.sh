# The GPU results (results/), on the lent H200 machine, from the repository root; each call stays within
# BUDGET seconds (default 500) and leaves one tarball in $OUT, whatever finished.
#   bash scripts/gpu-results.sh 1   # public-API path: the tutorial's experiment, the 806 M model at stages
#                                   # 0-3 in fp16 and bf16, GPT-2 small (calibrated) in fp16
#   bash scripts/gpu-results.sh 2   # GPT-2 (calibrated) in fp16, the 1.1 B Llama in bf16, the engines, offload
#   bash scripts/gpu-results.sh 3   # PyTorch's ZeRO-1 and FSDP2 (+- checkpointing) and DeepSpeed's optimizer offload
#   bash scripts/gpu-results.sh 4   # GPT-2 in bf16 and the 1.1 B Llama in fp16 (each calibrated)
# GPUS=2 adds the 2-GPU points where the machine has them.
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/res.XXXX); START=$(date +%s); W=${GPUS:-1}
WORKERS=$([ "$W" -ge 2 ] && echo "[1,2]" || echo "[1]")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
left() { echo $(( ${BUDGET:-500} - ($(date +%s) - START) )); }
run() {
  local name=$1; shift; local t; t=$(left)
  if [ "$t" -lt 45 ]; then echo "$name: not run, $t s left"; return; fi
  timeout "$t" python3 -m ray_zero "$@" --output $R/$name > $R/$name.log 2>&1
  echo "$name rc=$? at $(( $(date +%s) - START )) s"; grep -E "^ray_zero: [a-z_]*stage|error|activations per" $R/$name.log | cut -c1-230
}
case "${1:-1}" in
  1) run smoke-h200 sweep experiments/quick.yaml --set steps=6 --set 'grid.num_workers=[1]' --set 'grid.stage=[1]'
     run zero1_mnist-h200 sweep experiments/zero1_mnist.yaml
     run large_fp16-h200 sweep experiments/memory_scaling.yaml --set 'grid.stage=[0,1,2,3]' --set "grid.num_workers=$WORKERS" --set steps=20
     run large_bf16-h200 sweep experiments/memory_scaling.yaml --set precision=bf16 --set 'grid.stage=[0,1,2,3]' --set "grid.num_workers=$WORKERS" --set steps=20
     run gpt2_fp16-h200 sweep experiments/gpt2_zero.yaml --set "grid.num_workers=$WORKERS" --set steps=20 ;;
  2) run gpt2_fp16-h200 sweep experiments/gpt2_zero.yaml --set "grid.num_workers=$WORKERS" --set steps=15 --set 'grid.micro_batch_size=[4,16]'
     run llama_1b_bf16-h200 sweep experiments/llama_1b.yaml --set "grid.num_workers=$WORKERS" --set steps=12
     run engines_large-h200 sweep experiments/engines_large.yaml --set "grid.num_workers=$WORKERS"
     run offload_large-h200 sweep experiments/offload_large.yaml --set "grid.num_workers=$WORKERS"
     run gpt2_bf16-h200 sweep experiments/gpt2_zero.yaml --set precision=bf16 --set "grid.num_workers=$WORKERS" --set steps=20 ;;
  3) run engines_torch_fsdp-h200 sweep experiments/engines_large.yaml --set "grid.num_workers=$WORKERS" \
       --set 'grid.backend=[torch_zero,fsdp]' --set 'grid.stage=[1,2,3]' --set steps=15
     run offload_large-h200 sweep experiments/offload_large.yaml --set "grid.num_workers=$WORKERS" ;;
  4) run gpt2_bf16-h200 sweep experiments/gpt2_zero.yaml --set precision=bf16 --set "grid.num_workers=$WORKERS" \
       --set steps=15 --set 'grid.micro_batch_size=[4,16]'
     run llama_1b_fp16-h200 sweep experiments/llama_1b.yaml --set precision=fp16 --set "grid.num_workers=$WORKERS" --set steps=12 ;;
esac
cd $R && tar czf $OUT/results-$1.tgz --exclude='tune*' --exclude='train' . ; echo "done at $(( $(date +%s) - START )) s"
