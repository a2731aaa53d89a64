# bench/results on the lent 2 x H200 machine: ray_zero against bare DeepSpeed, then packing.
#   bash scripts/gpu-bench.sh large     # the 806 M model, workers 1 and 2, stage 0 and 1
#   bash scripts/gpu-bench.sh seed      # the seed model: stage 0/1 x micro-batch 32/64 x 1/2 GPUs, 300 steps
#   bash scripts/gpu-bench.sh packing   # the seed model: eight 1-worker trials on the 2 GPUs
#   bash scripts/gpu-bench.sh throughput EXPERIMENT --set ... --throughput 3   # samples/s only, repeated
#   bash scripts/gpu-bench.sh throughput experiments/quick.yaml --set 'grid.num_workers=[1]' --set 'grid.stage=[1]' \
#        --set steps=4020 --set warmup_steps=20 --throughput 4 --side-by-side   # bare and ray_zero at once, a GPU each
#   PIN_CPUS=4 bash scripts/gpu-bench.sh ...   # everything (bench, torchrun, Ray) on 4 CPUs next to each GPU
#   bash scripts/gpu-bench.sh throughput ... --set worker_niceness=15   # ray_zero's ranks at Ray's default niceness
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/bench.XXXX)   # fresh: a sweep refuses a folder that holds results
python3 -c "import torch, deepspeed, ray.train.torch"   # compile and cache the imports once, for both sides
PIN=""
if [ -n "${PIN_CPUS:-}" ]; then   # the first PIN_CPUS CPUs of each GPU's NUMA-local list (sysfs)
  CPUS=$(python3 scripts/gpu_local_cpus.py "$PIN_CPUS") && PIN="taskset -c $CPUS" && echo "pinned: $PIN"
fi
case "$1" in
  large) timeout 400 $PIN python3 bench/bench.py experiments/memory_scaling.yaml --set 'grid.num_workers=[1,2]' \
           --set steps=60 --set warmup_steps=10 --output $R/large-h200x2 > $R/large.log 2>&1 ;;
  seed)  timeout 480 $PIN python3 bench/bench.py experiments/quick.yaml --set steps=300 --set warmup_steps=20 \
           --set 'grid.micro_batch_size=[32,64]' --output $R/seed-h200x2 > $R/seed.log 2>&1 ;;
  throughput) shift; timeout 540 $PIN python3 bench/bench.py "$@" --output $R/throughput > $R/throughput.log 2>&1 ;;
  packing) timeout 330 $PIN python3 bench/bench.py experiments/quick.yaml --set steps=300 --set warmup_steps=20 \
           --only-packing --output $R/packing-h200x2 > $R/packing.log 2>&1 ;;
esac
echo "rc=$?"; grep -E "^ray_zero|^bench|^\| |^- |Error" $R/*.log | tail -70
cd $R && tar czf $OUT/$(basename $R).tgz --exclude='tune' --exclude='train' .   # one per call: several calls can share $OUT
