# Issue 65's GPU population on the lent GPU machine, from the repository root: bench/population_gpu.py (one
# process per family, several at once, no Ray) runs the families not yet recorded in DIR, starting none
# after BUDGET seconds (each has TIMEOUT seconds of its own), then tars DIR whole into $OUT/population.tgz.
# Resumable: DIR (default results/population-h100) travels with the working tree, so untar the tarball
# there (`tar xzf population.tgz -C results/population-h100`) before the next part.
#   bash scripts/gpu-population.sh [--set tuning|held-out] [--only FAMILY ...] [--ops]
#   BUDGET=300 TIMEOUT=180 JOBS=4 DIR=results/population-h100 (the defaults: a part ends within ~9 minutes)
set -u
NO_RAY=1 source scripts/gpu-env.sh
DIR=${DIR:-results/population-h100}
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$DIR/gpu.txt"
python3 bench/population_gpu.py --output "$DIR" --budget-s "${BUDGET:-300}" --timeout-s "${TIMEOUT:-180}" \
  --jobs "${JOBS:-4}" "$@" 2>&1 | tee -a "$DIR/parts.log" | grep -E "^\[|^population" | cut -c1-300
tar czf "$OUT/population.tgz" -C "$DIR" . ; echo "population: tarball $(du -h "$OUT/population.tgz" | cut -f1)"
