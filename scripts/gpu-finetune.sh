# Issue 66's GPU tables on the lent GPU machine, from the repository root: bench/finetune_gpu.py (one process
# per family, all three at once, no Ray) runs the families not yet recorded in DIR, each within TIMEOUT
# seconds of its own, then prints the tables and tars DIR whole into $OUT/finetune.tgz. Needs peft and
# accelerate in .whl/ (EXTRA_WHEELS="peft==0.21.2 accelerate==1.16.0" ../shared/tools/gpu-bundle.sh).
# Resumable: DIR travels with the working tree; untar the tarball there before a second call.
#   bash scripts/gpu-finetune.sh [--only llama bert vit] [--retry timeout "some forms failed"]
#   TIMEOUT=420 JOBS=3 DIR=results/finetune-h100 (the defaults: a call ends within ~8 minutes)
set -u
NO_RAY=1 source scripts/gpu-env.sh
DIR=${DIR:-results/finetune-h100}
mkdir -p "$DIR"
# gpu-env.sh installs .whl/ once per machine: a machine warm from a bundle without peft gets its wheels now
python3 -c "import peft" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-compile \
  --target "$SITE" .whl/peft-*.whl .whl/accelerate-*.whl 2>/dev/null
python3 -c "import peft, accelerate" || { echo "finetune: no peft or accelerate in .whl/ (see above)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$DIR/gpu.txt"
python3 bench/finetune_gpu.py --output "$DIR" --budget-s 60 --timeout-s "${TIMEOUT:-420}" --jobs "${JOBS:-3}" "$@" \
  2>&1 | tee -a "$DIR/parts.log" | grep -E "^\[|^finetune|^population" | cut -c1-400
python3 bench/finetune_gpu.py --table "$DIR" | tee "$DIR/table.md"
tar czf "$OUT/finetune.tgz" -C "$DIR" . ; echo "finetune: tarball $(du -h "$OUT/finetune.tgz" | cut -f1)"
