# On the lent 2 x H200 machine: the side-by-side throughput pairs (seed model, stage 1, 1 GPU each side)
# with both sides' training processes on CPUs of their own, away from everything else: the benchmark, Ray
# and every process they start run on CPUs 8-31 (taskset), and a loop moves every thread of each bare
# rank and each Ray Train worker (and so the threads they start later, autograd's too) to CPUs 0-7.
# Both sides share those 8 CPUs; nothing else runs there.
#   bash scripts/gpu-side-by-side-isolated.sh --set steps=1220 --set warmup_steps=20 --throughput 4
set -u
source scripts/gpu-env.sh
TRAINERS='^[^ ]*python[^ ]* .*bare_deepspeed[.]py|^ray::RayTrainWorker'  # not a shell that names them
isolate() {
  while true; do
    for pid in $(pgrep -f "$TRAINERS"); do taskset -a -cp 0-7 "$pid" > /dev/null 2>&1; done
    sleep 0.5
  done
}
isolate &
taskset -c 8-31 bash scripts/gpu-bench.sh throughput experiments/quick.yaml --set 'grid.num_workers=[1]' \
  --set 'grid.stage=[1]' "$@" --side-by-side
kill %1
