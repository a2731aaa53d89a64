# Source this on the lent GPU machine (no network, no Ray/DeepSpeed there): installs the offline
# bundle that ../shared/tools/gpu-bundle.sh built into .whl/, and keeps NVLink multicast off.
#   source scripts/gpu-env.sh
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
# Once per machine (scripts that call each other source this again); NO_RAY=1: a script that needs no Ray.
[ -d "$SITE/deepspeed" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl
# Ray's tarball (30 MiB) travels apart, in .ray/ (carry [".whl", ".ray"]), or in .whl/ as the bundle makes it:
# .whl/ and a population's records together stay within a call's 64 MiB.
[ -n "${NO_RAY:-}" ] || [ -d "$SITE/ray" ] || tar -xJf "$(ls .ray/ray-*.tar.xz .whl/ray-*.tar.xz 2>/dev/null | head -1)" -C "$SITE"
export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
# Every process compiled the machine's torch from source at start (py-spy, bench/startup_profile.md):
# Python found no cached bytecode it could use. Cache it in a writable folder, as a pip-installed torch has.
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
