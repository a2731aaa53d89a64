# On the lent 2 x H200 machine: the side-by-side throughput pairs (seed model, stage 1, 1 GPU each side),
# with py-spy sampling the first pair's two ranks, bare and ray_zero, for their whole lives (which thread
# holds the GIL, in which frames: --gil --threads, 200 Hz, without pausing them).
#   bash scripts/gpu-side-by-side-profile.sh --set steps=1220 --set warmup_steps=20 --throughput 3
#   SPY="--native --threads --rate 50" bash scripts/...   # C/C++ frames too, on every thread's CPU samples;
#                                        # py-spy pauses the process at each sample then (pair 1 only)
set -u
source scripts/gpu-env.sh
P=$(mktemp -d /tmp/profiles.XXXX)
newest() {  # the newest process whose command line has $1 and not $2
  for pid in $(pgrep -f "$1"); do tr '\0' ' ' < /proc/$pid/cmdline | grep -q -- "$2" || echo "$pid"; done | tail -1
}
spy() {  # $1: file name, $2, $3: as newest()
  local pid=""
  for _ in $(seq 2400); do pid=$(newest "$2" "$3"); [ -n "$pid" ] && break; sleep 0.25; done
  py-spy record --pid "$pid" ${SPY:---rate 200 --threads --gil --nonblocking} --format raw -o "$P/$1.txt" > "$P/$1.log" 2>&1
}
spy bare "bare_deepspeed.py" "torch.distributed.run" &
spy ray_zero "ray::RayTrainWorker" "no-such-argument" &
bash scripts/gpu-bench.sh throughput experiments/quick.yaml --set 'grid.num_workers=[1]' --set 'grid.stage=[1]' \
  "$@" --side-by-side
kill $(jobs -p) 2> /dev/null   # a spy still looking for its process
wait
tar czf "$OUT/profiles.tgz" -C "$P" .
