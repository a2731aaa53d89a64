"""Numbers: what a rank measures (meter), what the memory model predicts and what each engine's ranks
hold (memory_model, partitions), activations calibrated (calibration), fit's search on measured peaks
(search), opt-in host diagnostics. Never Ray or DeepSpeed; memory_model, partitions, calibration and
search need no torch either."""
