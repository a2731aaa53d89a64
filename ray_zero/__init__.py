"""ray_zero: measure what DeepSpeed ZeRO (and PyTorch's ZeRO-1, FSDP2, checkpointing, offload) buys in
memory and costs in speed, for your model, micro-batch and GPU count, with Ray Tune and Ray Train.

    import ray_zero
    ray_zero.log_to_console()
    results = ray_zero.sweep("experiments/quick.yaml")       # ray_zero/api.py says more

The layers, each importing only from those below it (pyproject.toml's import-linter contracts):
__main__ and api (the CLI and the Python API) > run (Ray: plan, cluster, trial, sweep, fit) > report
(tables, page, figures, estimate) > train (one rank: engines, DeepSpeed config, data, loop, fit's probes)
> rows > measure (meter, memory model, partitions, calibration, fit's search) > experiment_file > config
> models (sources, presets, description) > store, console.
"""

from ray_zero.api import FitResults, Results, bandwidth, estimate, experiment_of, fit, profile, sweep
from ray_zero.config import ConfigError, Experiment
from ray_zero.console import log_to_console

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "Experiment",
    "FitResults",
    "Results",
    "bandwidth",
    "estimate",
    "experiment_of",
    "fit",
    "log_to_console",
    "profile",
    "sweep",
]
