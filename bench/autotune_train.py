"""The training script DeepSpeed's autotuner launches: ray_zero's model and synthetic batches for an
experiment.

    deepspeed --autotuning tune bench/autotune_train.py --deepspeed_config ds_config.json EXPERIMENT.yaml
    [--set K=V ...]
    deepspeed bench/autotune_train.py --deepspeed_config ds_config.json EXPERIMENT.yaml     # one fixed config

The autotuner rewrites the value after --deepspeed_config (a base64 config per experiment) and reruns this
script under the `deepspeed` launcher; `deepspeed.initialize(args=...)` reads it. With autotuning on, the
engine itself ends the process: in the first forward of the model-info profile run (after writing
model_info.json) and at end_profile_step + 1 (after writing metrics.json). Anything on stderr containing
"error" makes the autotuner count the experiment as failed (deepspeed/autotuning/utils.py search_error),
so warnings and logs go to stdout here; an out-of-memory traceback still goes to stderr, as it should.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import traceback

from common import ROOT

sys.path.insert(0, str(ROOT))


class _StderrToStdout(io.TextIOBase):
    """sys.stderr for what Python writes there (warnings, log records: torch's handler looks sys.stderr up
    at every record) that lands on stdout. fileno() stays 2: DeepSpeed's op checks silence a test compile
    by pointing sys.stderr.fileno() at /dev/null, and must still silence the real stderr."""

    encoding = "utf-8"

    def write(self, text: str) -> int:
        return sys.stdout.write(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def fileno(self) -> int:
        return sys.__stderr__.fileno()


def _only_failures_on_stderr() -> None:
    """The autotuner reads any "error" on an experiment's stderr as its failure: warnings and logs go to
    stdout, an uncaught exception (an out-of-memory error) to stderr (C++ warnings still write to fd 2)."""
    sys.stderr = _StderrToStdout()
    sys.excepthook = lambda kind, value, trace: traceback.print_exception(
        kind, value, trace, file=sys.__stderr__
    )


def main() -> None:
    _only_failures_on_stderr()
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    from ray_zero.experiment_file import load_experiment
    from ray_zero.models.describe import build_model_spec
    from ray_zero.models.spec import SYNTHETIC_BATCHES, cast_floating
    from ray_zero.train.data import synthetic_batches

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config: the autotuner's hook
    args = parser.parse_args()
    experiment = load_experiment(args.experiment, args.set)

    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank))
    get_accelerator().set_device(local_rank)
    device = torch.device(get_accelerator().device_name(local_rank))
    torch.manual_seed(experiment.seed)  # the same initial weights as a ray_zero trial
    spec = build_model_spec(experiment.model_source())
    spec.module.to(device).train()
    engine, _, _, _ = deepspeed.initialize(
        args=args,
        model=spec.module,
        model_parameters=[p for p in spec.module.parameters() if p.requires_grad],
    )
    # The autotuner chooses the micro-batch and gradient accumulation: take them from the engine.
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dtype = (
        torch.float16
        if engine.fp16_enabled()
        else torch.bfloat16
        if engine.bfloat16_enabled()
        else torch.float32
    )
    pool = synthetic_batches(
        spec.make_batch, micro, SYNTHETIC_BATCHES, experiment.seed + engine.global_rank, device
    )
    steps = experiment.steps
    if engine.autotuning_enabled():  # reach the profile window even when the experiment is shorter
        steps = max(steps, engine.autotuning_end_profile_step() + 2)
    # ray_zero's stage-0 fp16 loss-scale workaround (ray_zero/train/deepspeed_engine.py) is left out: it
    # changes the updates, not the time a step takes, which is all the autotuner measures.
    for step in range(steps * accumulation):
        loss = spec.loss(engine, cast_floating(pool[step % len(pool)], dtype))
        engine.backward(loss)
        engine.step()  # counts micro-steps; steps the optimizer at each accumulation boundary
    print(
        f"autotune_train: {steps} steps of {accumulation} x {micro} samples, last loss {loss.item():.4f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
