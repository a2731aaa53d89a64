"""What one rank reports (ray_zero/train/worker.py's result, a probe's in fit): per_rank.csv's columns in
their order, then the fields only trials.jsonl keeps. Units are in the names too (`_gib`, `_bytes`, `_s`,
`_at` / `_from` / `_until`: seconds since the epoch)."""

from __future__ import annotations

from ray_zero.schema.columns import Registry, column

P, R = "per_rank", "record"

RANK = Registry(
    [
        column("trial", str, "", P, "the trial the rank belongs to"),
        column("rank", int, "", P, "the rank in its trial's process group"),
        column("attempt", int, "", P, "which attempt of the trial (Ray Train restarts a worker group)"),
        column("node_id", str, "", P, "the Ray node the rank ran on"),
        column("device_name", str, "", P, "the rank's device: a GPU's name, or cpu"),
        column("device_memory_gib", float, "GiB", P, "the GPU's memory (GPU only)"),
        column("memory_kind", str, "", P, "cuda (the CUDA allocator's bytes) or cpu_rss (the resident set)"),
        *(
            column(
                f"memory_after_{phase}_gib",
                float,
                "GiB",
                P,
                f"allocated memory (GPU) or resident set (CPU) after the {text}",
            )
            for phase, text in (
                ("model", "model is built and on its device"),
                ("data", "rank's data is made"),
                ("initialize", "engine is set up"),
                ("first_backward", "first micro-batch's backward"),
                ("first_step", "first optimizer step"),
            )
        ),
        column("peak_allocated_gib", float, "GiB", P, "peak allocated (GPU) or resident set (CPU), whole trial"),
        column("peak_reserved_gib", float, "GiB", P, "peak reserved by the CUDA caching allocator (GPU)"),
        column("timed_peak_allocated_gib", float, "GiB", P, "peak allocated over the timed steps (reset after warm-up)"),
        column("nvml_used_gib", float, "GiB", P, "this process's memory as nvidia-smi shows it, CUDA context included"),
        column("peak_reset_failed", bool, "", P, "the peak could not be reset (CPU: /proc/self/clear_refs refused): peaks include set-up"),
        column("parameter_bytes", int, "bytes", P, "parameters this rank holds, each storage once (a shard: its local part)"),
        column("gradient_bytes", int, "bytes", P, "gradients this rank holds (the larger of after the first backward and now)"),
        column("master_param_bytes", int, "bytes", P, "fp32 master copies of the parameters (mixed precision)"),
        column("optimizer_state_bytes", int, "bytes", P, "Adam's states this rank holds"),
        column("other_optimizer_bytes", int, "bytes", P, "buckets and flat buffers the optimizer holds beside them"),
        column("data_bytes", int, "bytes", P, "this rank's data on its device (MNIST shard or synthetic batches)"),
        column("saved_for_backward_bytes", int, "bytes", P, "what autograd saved in one micro-batch's forward, each storage once, parameters left out"),
        column("micro_batch_rise_bytes", int, "bytes", P, "GPU: how far one micro-batch's forward and backward raised allocated memory"),
        column("loss_first", float, "", P, "training loss of the first step"),
        column("loss_last", float, "", P, "training loss of the last step"),
        column("loss_by_epoch", list, "", P, "mean loss of each epoch (MNIST)"),
        column("samples_per_s", float, "samples/s", P, "this rank's samples per second over the timed steps"),
        column("window_samples_per_s_median", float, "samples/s", P, "the median of the timed windows' rates (runtime.live_metrics_every steps each)"),
        column("window_samples_per_s_p90", float, "samples/s", P, "the 90th percentile of the timed windows' rates"),
        column("tflops", float, "TFLOP/s", P, "model FLOPs per second (counted once: recomputation not credited); blank where the FLOPs could not be counted"),
        column("mfu", float, "", P, "tflops over the device's dense peak (a GPU the peak table names)"),
        column("mfu_blank", str, "", P, "why mfu (and, FLOPs not counted, tflops) is blank, in one line"),
        column("steps", int, "", P, "optimizer steps trained: the experiment's, and timed steps added to settle the timing (not the counted steps)"),
        column("timed_steps", int, "", P, "steps timed (after warm-up)"),
        column("step_median_s", float, "s", P, "the timed steps' median step, its start to the end of its optimizer step"),
        column("step_spread", float, "", P, "the timed steps' interquartile range over their median (blank under 2 steps)"),
        column("timing_unstable", bool, "", P, "the timed window ended short of timing_min_s or with a step_spread above timing_spread (its step budget spent)"),
        column("counted_steps", int, "", P, "untimed steps after the timed window, collectives counted there (comm_*_bytes, exposed_comm_s)"),
        column("model_build_s", float, "s", P, "building the model on the rank's device"),
        column("data_load_s", float, "s", P, "making the rank's data"),
        column("initialize_s", float, "s", P, "setting the engine up (deepspeed.initialize, DDP, fully_shard)"),
        column("turn_wait_s", float, "s", P, "waiting for the GPU (trials sharing one): to set up, and for the measurement turn"),
        column("warmup_s", float, "s", P, "the warm-up steps (not timed)"),
        column("timed_s", float, "s", P, "the timed steps"),
        column("data_source", str, "", P, "where the rank's data came from"),
        column("step_s", float, "s", P, "a timed step, from its start to the end of its optimizer step (mean)"),
        column("forward_s", float, "s", P, "its forwards (timed steps), less the share collectives held the rank up in them in the counted steps (mean)"),
        column("backward_s", float, "s", P, "its backwards (timed steps), less the share collectives held the rank up in them in the counted steps (mean)"),
        column("optimizer_s", float, "s", P, "its optimizer step (timed steps), less the share collectives held the rank up in it in the counted steps (mean)"),
        column("exposed_comm_s", float, "s", P, "the phases' time that collectives held the rank up (blocking calls, waits; GPU: the stream's waits), by each phase's share in the counted steps (mean)"),
        *(
            column(f"comm_{kind}_bytes", int, "bytes", P, f"{kind.replace('_', '-')} messages a step sent (nccl-tests' message size), counted after the timed window")
            for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce")
        ),
        # trials.jsonl only
        column("pid", int, "", R, "the rank's process id, as the Ray dashboard lists it"),
        column("device_uuid", str, "", R, "the GPU's UUID: trials on one GPU take turns on it"),
        column("engine_config", dict, "", R, "what the engine was built with (DeepSpeed: its config, key for key)"),
        column("loss_scale_fix", str, "", R, "DeepSpeed fp16 stage 0's loss scaling (deepspeedai/DeepSpeed#8393): applied, or why not"),
        column("warmup_steps_added", int, "steps", R, "fp16: warm-up steps added until the optimizer stepped (the loss scale skipped the first)"),
        column("set_up_from", float, "s", R, "when the rank began its set-up (epoch seconds)"),
        column("set_up_until", float, "s", R, "when its engine was set up (epoch seconds)"),
        column("measuring_from", float, "s", R, "when its warm-up began, after its turn (epoch seconds)"),
        column("measuring_until", float, "s", R, "when its timed steps ended (epoch seconds)"),
        column("diagnostics", dict, "", R, "--diagnostics: host figures (diagnostics.csv)"),
        # a fit probe's own
        column("probe_status", str, "", R, "fit: ok or oom"),
        column("micro_batch_size", int, "", R, "fit: the probe's micro-batch"),
        column("seq_len", int, "tokens", R, "fit: the probe's seq_len (a seq_len axis, or fit --target seq_len)"),
        column("label", str, "", R, "fit: calibration, timed, or the search's probe"),
        column("first_guess", int, "", R, "fit: the micro-batch the search started from"),
        column("left_bytes", int, "bytes", R, "fit: memory in use after the probe's teardown above before it"),
        column("run", str, "", R, "fit: the Ray Train run the probe ran in"),
        column("error", str, "", R, "fit: why the probe failed"),
        column("phase", str, "", R, "out of memory: the phase the rank was in"),
        column("allocated_gib", float, "GiB", R, "out of memory: allocated at the failure"),
        column("reserved_gib", float, "GiB", R, "out of memory: reserved at the failure"),
    ]
)

LEGACY = frozenset(
    {
        "data_loaded_at",
        "finished_at",
        "first_step_at",
        "gradient_bytes_after_backward",
        "initialized_at",
        "model_built_at",
        "process_started_at",
        "timed_peak_reserved_gib",
        "train_fn_started_at",
        "train_started_at",
        "warmed_up_at",
    }
)
"""Fields of earlier versions' per-rank reports: read from old trials.jsonl files, never written."""
