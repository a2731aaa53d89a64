"""One rank: the engines (DeepSpeed ZeRO, DDP + ZeroRedundancyOptimizer, FSDP2), its data, DeepSpeed's
config, the training loop (worker.train) and fit's in-process probes. torch and DeepSpeed: never Ray."""
