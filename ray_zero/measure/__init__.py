"""Numbers: what a rank measures (meter), what the memory model predicts (prediction, engine_memory,
memory_model) and what each engine's ranks hold (partitions), activations calibrated (calibration), fit's
search on measured peaks (search), opt-in host diagnostics. Never Ray or DeepSpeed; prediction,
engine_memory, memory_model, partitions, calibration and search need no torch either."""
