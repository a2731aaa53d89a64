# bench/ on the lent GPU machine (bench/README.md): ray_zero against bare DeepSpeed, packing, start-up.
#   bash scripts/gpu-bench.sh large     # 2 GPUs: the 806 M model, workers 1 and 2, stage 0 and 1
#   bash scripts/gpu-bench.sh seed      # 2 GPUs: the seed model, stage 0/1 x micro-batch 32/64 x 1/2 GPUs
#   bash scripts/gpu-bench.sh packing   # 2 GPUs: the seed model, eight 1-worker trials
#   bash scripts/gpu-bench.sh startup   # 2 GPUs: bench/startup_profile.py, a sweep's first trial, twice
#   bash scripts/gpu-bench.sh throughput EXPERIMENT --set ... --throughput 5   # samples/s and first-trial
#        overhead only, bare and ray_zero alternating; add --side-by-side (1-worker points, 2 GPUs) to run
#        them at the same time, a GPU each
set -u
source scripts/gpu-env.sh
R=$(mktemp -d /tmp/bench.XXXX)   # fresh: a sweep refuses a folder that holds results
python3 -c "import torch, deepspeed, ray.train.torch, ray.tune"   # compile and cache the imports once, for both sides
case "$1" in
  large) timeout 400 python3 bench/bench.py experiments/memory_scaling.yaml --set 'grid.num_workers=[1,2]' \
           --set steps=60 --set warmup_steps=10 --output $R/large-h200x2 > $R/large.log 2>&1 ;;
  seed)  timeout 480 python3 bench/bench.py experiments/quick.yaml --set steps=300 --set warmup_steps=20 \
           --set 'grid.micro_batch_size=[32,64]' --output $R/seed-h200x2 > $R/seed.log 2>&1 ;;
  throughput) shift; timeout 540 python3 bench/bench.py "$@" --output $R/throughput > $R/throughput.log 2>&1 ;;
  packing) timeout 330 python3 bench/bench.py experiments/quick.yaml --set steps=300 --set warmup_steps=20 \
           --only-packing --output $R/packing-h200x2 > $R/packing.log 2>&1 ;;
  startup) for n in 1 2; do   # the second run is the one to read: the first may still compile bytecode
             timeout 200 python3 bench/startup_profile.py experiments/quick.yaml --set 'grid.stage=[1]' \
               --set 'grid.num_workers=[2]' --set steps=220 --set warmup_steps=20 --output $R/startup-$n \
               > $R/startup-$n.log 2>&1; echo "startup $n rc=$?"
           done ;;
  *) echo "usage: bash scripts/gpu-bench.sh large|seed|packing|startup|throughput ..."; exit 2 ;;
esac
echo "rc=$?"; grep -E "^ray_zero|^bench|^\| |^- |Error" $R/*.log | tail -70
cd $R && tar czf $OUT/$(basename $R).tgz --exclude='tune' --exclude='train' .   # one per call: several calls can share $OUT
