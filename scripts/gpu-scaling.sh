# Issue 56 on a lent host of G GPUs (nvidia-h100-x2/x4/x8, nvidia-h200-x2/x4/x8): bus bandwidth at 2..G
# ranks, then scaling grids of GPT-2 small and a Llama-1B shape over DeepSpeed 0-3, DDP, DDP + ZeRO-1
# and FSDP2 at 1, 2, 4, 8 workers (as many as the host has), in parts that each end within BUDGET s
# (default 500: a device call allows 600). Each part leaves a tarball of its folders in $OUT; then, here,
# `python scripts/scaling_table.py DIR...` makes the three tables (memory, speed, bytes).
#   bash scripts/gpu-scaling.sh bandwidth
#   bash scripts/gpu-scaling.sh gpt2 bf16 1        # MODEL PRECISION ACCUMULATION; MODEL: gpt2 | llama
#   bash scripts/gpu-scaling.sh llama fp16 4
set -u
source scripts/gpu-env.sh
G=$(nvidia-smi -L | wc -l)
WORKERS=$(python3 -c "print([n for n in (1, 2, 4, 8) if n <= $G])")
R=$(mktemp -d /tmp/scaling.XXXX)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $R/gpu.txt
case "$1" in
  bandwidth)
    for n in $(seq 2 $G); do
      timeout ${BUDGET:-500} python3 -m ray_zero bandwidth --workers $n --output $R/bandwidth-$n.json \
        2>&1 | tail -12 | tee -a $R/bandwidth.log
    done ;;
  gpt2|llama)
    experiment=experiments/gpt2_zero.yaml; mb=8
    [ "$1" = llama ] && { experiment=experiments/llama_1b.yaml; mb=2; }
    timeout ${BUDGET:-500} python3 -m ray_zero sweep $experiment --output $R/$1-$2-accum$3 --quiet \
      --set precision=$2 --set gradient_accumulation_steps=$3 --set steps=12 --set warmup_steps=4 \
      --set 'grid.backend=[deepspeed,torch_zero,fsdp]' --set 'grid.stage=[0,1,2,3]' \
      --set "grid.micro_batch_size=[$mb]" --set "grid.num_workers=$WORKERS" --set calibrate=false \
      2>&1 | tail -40 | tee $R/$1-$2-accum$3.log ;;
  *) echo "usage: bash scripts/gpu-scaling.sh bandwidth | gpt2|llama bf16|fp16 1|4"; exit 2 ;;
esac
cd $R && tar czf $OUT/$(basename $R).tgz --exclude='tune*' --exclude='train' . ; echo "scaling: $(du -h $OUT/*.tgz)"
