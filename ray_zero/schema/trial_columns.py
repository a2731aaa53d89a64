"""A trial's row: results.csv's columns in their order, then what only trials.jsonl keeps (the rest of
the point and the model, each rank figure's other aggregates, times, fit's fields, every rank's report).
`how`/`of`: how the value is made from the ranks' reports (ray_zero/rows.py aggregates by these)."""

from __future__ import annotations

from ray_zero.schema.columns import Registry, column

T, R = "results", "record"
PAGE, MD, CONSOLE = "page", "md", "console"

_TIMES = ("model_build_s", "data_load_s", "initialize_s", "turn_wait_s", "warmup_s", "timed_s")
_STATES = ("parameter", "gradient", "master_param", "optimizer_state")
_SPLIT = ("step_s", "forward_s", "backward_s", "optimizer_s", "exposed_comm_s")
_COMM = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")


def _extremes(rank_name: str, unit: str, text: str, tier_of_max: str = R) -> list:
    """A rank figure's max and min over ranks (bytes keep `_per_rank` in their names)."""
    stem = f"{rank_name[: -len('_bytes')]}_bytes_per_rank" if rank_name.endswith("_bytes") else rank_name
    type_ = int if unit == "bytes" else float
    return [
        column(f"{stem}_max", type_, unit, tier_of_max, f"{text}, the largest rank", how="max", of=rank_name),
        column(f"{stem}_min", type_, unit, R, f"{text}, the smallest rank", how="min", of=rank_name),
    ]


TRIAL = Registry(
    [
        column("trial", str, "", T, "the point's name: stage1_mb64_w2, fsdp_stage3_mb8_w2_ac (_ac: activation checkpointing, _offloadcpu: optimizer offload, _s512: seq_len on a seq_len axis, _calibration / _timed: a calibration or fit timing trial)", heading="trial", hint="the trial's name: its grid point", views={PAGE, MD, CONSOLE}, place=0),
        column("backend", str, "", T, "deepspeed (ZeRO stages 0-3), torch_zero (0: DDP, 1: DDP + ZeroRedundancyOptimizer), fsdp (FSDP2; 2: parameters stay gathered from forward to backward, 3: resharded after forward)", heading="backend", hint="deepspeed, torch_zero (DDP + ZeroRedundancyOptimizer) or fsdp (FSDP2)", views={PAGE}, place=1),
        column("stage", int, "", T, "ZeRO stage: what is partitioned across ranks", heading="stage", hint="ZeRO stage", views={PAGE}, place=2),
        column("micro_batch_size", int, "", T, "samples per rank per forward and backward", heading="micro-batch", hint="samples per rank per step", views={PAGE}, place=3),
        column("num_workers", int, "", T, "data-parallel ranks", heading="workers", hint="data-parallel ranks", views={PAGE}, place=4),
        column("activation_checkpointing", bool, "", T, "each block's activations recomputed in backward", heading="ckpt", hint="activation checkpointing", views={PAGE}, place=5),
        column("offload_optimizer", str, "", T, "cpu: DeepSpeed keeps the fp32 master and Adam's states in host memory and steps them there", heading="offload", hint="where the optimizer's states live", views={PAGE}, place=6),
        column("seq_len", int, "tokens", R, "tokens per sample on a seq_len axis (grid.seq_len; the trial's name ends _s512); blank: the experiment's one seq_len", heading="seq_len", hint="tokens per sample (a seq_len axis)", views={PAGE}, place=6),
        column("precision", str, "", T, "fp16 / bf16 (mixed precision; GPU) or fp32", heading="precision", hint="training precision", views={PAGE, MD}, place=7),
        column("model", str, "", T, "the model source", heading="model", hint="model", views={PAGE}, place=8),
        column("params", int, "parameters", T, "its parameter count (on the meta device, before Ray starts)", heading="params", hint="parameters", views={PAGE}, place=9),
        column("dataset", str, "", T, "mnist (presets) or synthetic (random batches shaped for the model)", heading="dataset", hint="dataset", views={PAGE}, place=10),
        column("steps", int, "", T, "optimizer steps", heading="steps", hint="optimizer steps", how="first", of="steps", views={PAGE}, place=11),
        column("status", str, "", T, "ok; oom (out of memory: the memory at the failure is in the row); failed (with error, after runtime.max_failures retries); timeout (stopped past runtime.trial_timeout_s, in the phase error names; its ranks' stacks in stacks/TRIAL/); skipped (needs more workers than the cluster has, or an engine lacks the stage)", heading="status", hint="ok, oom (out of memory), failed or skipped", views={PAGE, MD, CONSOLE}, place=12),
        column("loss_first", float, "", T, "training loss of the first step", how="mean", of="loss_first"),
        column("loss_last", float, "", T, "training loss of the last step", heading="loss", hint="loss at the first step -> the last, mean over ranks (sorts by the last)", how="mean", of="loss_last", views={PAGE, MD, CONSOLE}, place=13),
        column("samples_per_s", float, "samples/s", T, "over the timed steps only (warm-up excluded, the device synchronised before the clock is read)", heading="samples/s", hint="timed steps, summed over ranks", how="sum", of="samples_per_s", views={PAGE, MD, CONSOLE}, place=14),
        column("samples_per_s_per_worker", float, "samples/s", T, "the mean rank's samples/s", heading="per rank", hint="samples/s per rank", how="mean", of="samples_per_s", views={PAGE}, place=15),
        column("mfu", float, "", T, "model FLOPs per second per rank (counted once by torch's FlopCounterMode: recomputation is not credited) over the card's dense fp16/bf16 peak; GPU only", heading="MFU", hint="model FLOPs utilisation (GPU)", how="mean", of="mfu", views={PAGE, MD}, place=16),
        column("mfu_blank", str, "", R, "why mfu (and, FLOPs not counted, tflops) is blank: FLOPs not counted, a GPU the peak table does not name, a CPU", how="first", of="mfu_blank"),
        column("step_median_s", float, "s", R, "the timed steps' median step, the slowest rank's", how="max", of="step_median_s"),
        column("step_spread", float, "", T, "the timed steps' interquartile range over their median, the widest rank's", how="max", of="step_spread"),
        column("timing_unstable", bool, "", R, "the timing's bound was not reached (timing_min_s, timing_spread) within the step budget (timing_max_steps) on some rank", how="any", of="timing_unstable"),
        column("peak_allocated_gib_max", float, "GiB", T, "GPU: the CUDA allocator's peak over the whole trial, engine set-up included; CPU: each worker process's peak resident set (Python, torch and Ray included)", heading="peak GiB", cpu_heading="peak RSS GiB", hint="peak memory per rank, max over ranks (CUDA allocated; on CPU the worker's resident set)", how="max", of="peak_allocated_gib", views={PAGE, MD, CONSOLE}, place=17),
        column("peak_reserved_gib_max", float, "GiB", T, "the CUDA caching allocator's peak reserved (GPU; on CPU the resident set again)", how="max", of="peak_reserved_gib"),
        column("memory_kind", str, "", T, "cuda or cpu_rss: what the memory columns measure", heading="memory", hint="cuda: the CUDA allocator's peak; cpu_rss: the process's resident set", how="first", of="memory_kind", views={PAGE}, place=22),
        column("optimizer_state_bytes_per_rank_max", int, "bytes", R, "Adam's states, each tensor storage counted once (a sharded tensor: this rank's shard)", how="max", of="optimizer_state_bytes"),
        column("measured_model_state_gib", float, "GiB", T, "parameters + gradients + fp32 master + optimizer states, counted tensor by tensor on the rank that holds the most", heading="states GiB", hint="model states counted tensor by tensor, on the rank that holds the most", how="fullest", of="parameter_bytes", views={PAGE, MD, CONSOLE}, place=20),
        column("predicted_model_state_gib", float, "GiB", T, "what the memory model predicts for them (each kind on the rank that holds the most of it)", heading="predicted states", hint="the memory model's model states per rank", views={PAGE, MD, "console_cpu"}, place=21),
        column("predicted_peak_gib", float, "GiB", T, "the memory model's peak for this row (GPU rows; needs the presets' shapes or a calibration for activations)", heading="predicted peak", hint="the memory model's peak per rank (GPU)", views={PAGE, MD, "console_gpu"}, place=18),
        column("measured_over_predicted", float, "", T, "the measured peak over the predicted (ok GPU rows)", heading="measured / predicted", hint="peak measured over predicted (ok GPU rows)", views={PAGE, MD}, place=19),
        column("prediction", str, "", R, "on what the formula used for this row was checked (\"checked on H200 ...\", \"unchecked\", \"activations calibrated\", \"model states only (CPU)\")"),
        column("activation_source", str, "", T, "where the prediction's activation term came from: traced (the point's training step traced on the meta device before any run), calibrated (short trials on the GPU measured it per sample), preset shapes, or none (why)"),
        column("wall_s", float, "s", T, "the trial's TorchTrainer.fit(): controller, workers, waiting for its GPU's turn, training, shutdown", heading="wall s", hint="the trial's wall time", views={PAGE, MD, CONSOLE}, place=23),
        column("attempts", int, "", T, "attempts whose ranks began training (a worker killed as its group starts is retried but not counted)", heading="attempts", hint="attempts the trial took", views={PAGE}, place=24),
        column("error", str, "", T, "why a row is not ok, in one line"),
        # trials.jsonl only (and the R columns above): the rest of the point and the model
        column("param_bytes", int, "bytes", R, "the parameters' bytes in the dtype the model is built in"),
        column("global_batch", int, "", R, "micro-batch x gradient accumulation x workers"),
        column("reduce_bucket_size", int, "elements", R, "ZeRO's reduce bucket"),
        column("flops_per_sample", float, "FLOP", R, "training FLOPs per sample (FlopCounterMode on the meta device)"),
        column("largest_block_params", int, "parameters", R, "the largest repeated block (what FSDP2 gathers at a time)"),
        column("sample_bytes", int, "bytes", R, "one sample's batch as the model makes it (inputs and labels): what synthetic data holds per sample"),
        column("param_elements_per_rank", float, "elements", R, "parameters the engine leaves on its fullest rank (from the shapes)"),
        column("gradient_elements_per_rank", float, "elements", R, "gradients the engine leaves on its fullest rank"),
        column("state_elements_per_rank", float, "elements", R, "elements whose master and Adam's states the fullest rank keeps"),
        column("trainable_params", float, "parameters", R, "parameters that train"),
        column("step_group_elements_per_rank", float, "elements", R, "the most elements the optimizer steps at once (ZeRO-3's sub-group; blank: the whole partition)"),
        column("gpu_share", float, "", R, "the share of a GPU each worker reserved (under 1: beside other trials on it)"),
        column("oom_while_sharing", str, "", R, "the error of a run out of memory beside other trials, before the trial ran again alone"),
        # the prediction, term by term (ray_zero/measure/memory_model.py), made once with the row
        *(column(f"predicted_{term}_gib", float, "GiB", R, f"the prediction's {term.replace('_', ' ')} term") for term in ("parameter", "gradient", "master_param", "optimizer_state", "bucket", "step_transient", "compute", "workspace", "data")),
        column("predicted_activation_gib", float, "GiB", R, "the prediction's activation term: what one micro-batch's forward, loss and backward add (traced: the step's peak, gradients as the engine holds them)"),
        column("traced_activation_bytes", float, "bytes", R, "what the traced step (meta device, the GPU's kernels) says one micro-batch adds, for this engine"),
        column("trace_form", str, "", R, "how the traced module ran: its dtype, autocast, checkpointing"),
        column("trace_attention", str, "", R, "the attention kernels the traced step took (flash, efficient, math), as CUDA would pick them"),
        column("trace_peak_ops", str, "", R, "the operators whose outputs were largest at the traced step's peak, GiB"),
        column("trace_note", str, "", R, "why the point's step could not be traced (then calibrated)"),
        column("calibrated_activation_gib", float, "GiB", R, "with a calibration beside a traced row: the calibrated activation term (a check)"),
        column("predicted_peak_calibrated_gib", float, "GiB", R, "with a calibration beside a traced row: the peak predicted with the calibrated term (a check)"),
        column("band_class", str, "", R, "the model's class for the error band: timm vision, Transformers text, Transformers vision/other, any model (presets, factories)"),
        column("predicted_band", str, "", R, "the error band of the predicted peak: measured/predicted - 1 of its class's rows on a GPU (ray_zero/measure/error_bands.json), widened where the torch or the GPU is outside what was measured, and why"),
        column("predicted_peak_high_gib", float, "GiB", R, "the predicted peak at its band's upper end"),
        column("inside_band", bool, "", R, "the measured peak lies inside the prediction's band (ok GPU rows)"),
        column("corrected_from", str, "", R, "the earlier trial of this engine whose measured peak lay above its band, and its excess over the prediction: a trial sharing a GPU took its share with it, a fit search its first guess (ray_zero/measure/correction.py)"),
        column("corrected_peak_gib", float, "GiB", R, "the predicted peak with that measured term (predicted_peak_gib stays the model's own)"),
        # the step's time predicted on a profiled device (runtime.profile; ray_zero/measure/point_speed.py)
        column("predicted_step_ms", float, "ms", R, "the step predicted from the traced step on the profile's device: per micro-batch the larger of the device's (compute + memory) and the host's (launches + hooks), then the optimizer's step and the exposed communication"),
        column("predicted_samples_per_s", float, "samples/s", R, "the predicted step's samples/s, summed over ranks as samples_per_s is", heading="predicted samples/s", hint="samples/s predicted from the traced step on runtime.profile's device, all ranks", views={PAGE, MD}, place=14),
        column("measured_over_predicted_speed", float, "", R, "measured samples/s over predicted (ok rows with a prediction; the profile's device may differ from the row's: speed_profile)", heading="measured / predicted speed", hint="samples/s measured over predicted (ok rows)", views={PAGE, MD}, place=14),
        column("predicted_speed_bound", str, "", R, "the term that sets the predicted step: compute, memory (bandwidth), host (launches and hooks) or communication", heading="bound", hint="what sets the predicted step: compute, memory, host or communication", views={PAGE, MD}, place=14),
        *(column(f"predicted_{term}_ms", float, "ms", R, f"the predicted step's {text}, per step") for term, text in (("compute", "kernels whose FLOPs set their time"), ("memory", "kernels whose bytes set their time"), ("host", "kernel launches on the host"), ("hooks", "engine hooks on the host (blank: the profile has no seconds per hook)"), ("optimizer", "optimizer step over the fullest rank's parameters"), ("comm", "communication its engine leaves exposed (blank above one worker: no bandwidth given)"))),
        column("speed_profile", str, "", R, "the profile the step was predicted on: its file, the device it measured (which may not be the row's), its date", heading="speed profile", hint="the profile the predicted speed was made on: its file, the device it measured, its date", views={PAGE}, place=14),
        column("speed_note", str, "", R, "why the predicted step is blank (no runtime.profile, the step not traced), or what it leaves out"),
        # the ranks' other figures
        column("peak_allocated_gib_min", float, "GiB", R, "peak allocated, the smallest rank", how="min", of="peak_allocated_gib"),
        column("peak_reserved_gib_min", float, "GiB", R, "peak reserved, the smallest rank", how="min", of="peak_reserved_gib"),
        *_extremes("timed_peak_allocated_gib", "GiB", "peak allocated over the timed steps"),
        *_extremes("nvml_used_gib", "GiB", "the process's memory as nvidia-smi shows it"),
        *(x for kind in _STATES for x in _extremes(f"{kind}_bytes", "bytes", f"{kind.replace('_', ' ')} bytes") if not x.name.startswith("optimizer_state_bytes_per_rank_max")),
        *_extremes("other_optimizer_bytes", "bytes", "buckets and flat buffers the optimizer holds"),
        *_extremes("data_bytes", "bytes", "the rank's data on its device"),
        *_extremes("saved_for_backward_bytes", "bytes", "what autograd saved in one micro-batch's forward"),
        *_extremes("micro_batch_rise_bytes", "bytes", "how far one micro-batch raised allocated memory"),
        column("peak_reset_failed", bool, "", R, "a rank could not reset its peak (CPU): its peaks include set-up", how="any", of="peak_reset_failed"),
        column("window_samples_per_s_median", float, "samples/s", R, "the timed windows' median rate, summed over ranks", how="sum_all", of="window_samples_per_s_median"),
        column("window_samples_per_s_p90", float, "samples/s", R, "the timed windows' 90th percentile, summed over ranks", how="sum_all", of="window_samples_per_s_p90"),
        column("tflops_per_worker", float, "TFLOP/s", R, "model FLOPs per second, the mean rank", how="mean", of="tflops"),
        column("loss_by_epoch", list, "", R, "each epoch's loss, mean over ranks (MNIST)", how="epochs", of="loss_by_epoch"),
        column("timed_steps", int, "", R, "steps timed", how="first", of="timed_steps"),
        column("data_source", str, "", R, "where the data came from", how="first", of="data_source"),
        column("device_name", str, "", R, "the ranks' device", how="first", of="device_name"),
        column("device_memory_gib", float, "GiB", R, "the GPU's memory", how="first", of="device_memory_gib"),
        *(column(name, float, "s", R, f"{name[:-2].replace('_', ' ')}, the slowest rank", how="slowest", of=name) for name in _TIMES),
        *(column(name, float, "s", R, f"a timed step's {name[:-2].replace('_', ' ')} (mean), mean over ranks", how="mean", of=name) for name in _SPLIT),
        *(column(f"comm_{kind}_bytes", int, "bytes", R, f"{kind.replace('_', '-')} bytes a timed step sent, the rank sending most", how="max", of=f"comm_{kind}_bytes") for kind in _COMM),
        *(column(f"predicted_comm_{kind}_bytes", int, "bytes", R, f"{kind.replace('_', '-')} bytes a step sends, as the communication model predicts them") for kind in _COMM),
        # when
        column("fit_started_at", float, "s", R, "when the trial's TorchTrainer.fit() began (epoch seconds)"),
        column("fit_finished_at", float, "s", R, "when it returned"),
        column("recorded_at", float, "s", R, "when the sweep recorded the row"),
        # fit's probes
        column("run", str, "", R, "fit: the Ray Train run the probe ran in"),
        column("search_started_at", float, "s", R, "fit: when the probe's search began"),
        column("first_guess", int, "", R, "fit: the micro-batch the search started from"),
        column("ranks_started_at", float, "s", R, "timeout: when the trial's first rank began (its bound counts from there)"),
        column("stacks", dict, "", R, "timeout: each rank's stack file, by rank (stacks/TRIAL/rankN.txt)"),
        # every rank
        column("per_rank", list, "", R, "every rank's report (per_rank.csv's rows)"),
        column("diagnostics", list, "", R, "--diagnostics: every rank's host figures (diagnostics.csv's rows)"),
    ]
)

LEGACY = frozenset(
    {
        "device",
        "driver_pid",
        "driver_process_started_at",
        "driver_started_at",
        "finished_at",
        "leftover_gib",
        "paper_model_state_gib",
        "process_started_at",
        "queued_s",
        "train_started_at",
        "tune_finished_at",
        "tune_started_at",
    }
)
"""Fields of earlier versions' rows: read from old trials.jsonl files, never written."""
