"""What a rank measures, on real tensors: memory after a phase, bytes saved for backward, timed rates;
and the opt-in host diagnostics."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch import nn

from ray_zero.measure.diagnostics import Diagnostics
from ray_zero.measure.meter import Meter, SavedForBackward


def test_saved_for_backward_counts_activations_once_and_not_the_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    small, large = SavedForBackward(), SavedForBackward()
    with small():
        model(torch.randn(8, 64)).sum().backward()
    with large():
        model(torch.randn(32, 64)).sum().backward()
    # Saved: the input (n x 64), the first output or its ReLU (n x 256, one storage shared by both), the
    # ReLU's output for the second linear: about n * (64 + 256 + 256) floats, no weight (64 K floats).
    assert 8 * 320 * 4 <= small.bytes <= 8 * 600 * 4
    assert large.bytes == 4 * small.bytes  # linear in the micro-batch


def test_saved_for_backward_leaves_out_frozen_weights_too():
    # A frozen layer over an input that needs its gradient (LoRA's base layers, a frozen layer above a
    # trainable one) saves only its weight, for the input's gradient: a parameter, not an activation.
    frozen = nn.Linear(64, 256).requires_grad_(False)
    saved = SavedForBackward()
    with saved():
        frozen(torch.randn(8, 64, requires_grad=True)).sum().backward()
    assert saved.bytes == 0


def test_a_forward_that_fails_before_its_backward_leaves_no_saved_tensor_alive():
    model, saved, kept = nn.Linear(64, 256), SavedForBackward(), []

    def failing_forward() -> None:
        out = model(torch.randn(8, 64)).relu()  # ReLU saves its own output
        kept.append(weakref.ref(out))
        raise torch.OutOfMemoryError("out of memory inside the forward")

    with pytest.raises(torch.OutOfMemoryError), saved():
        failing_forward()
    gc.collect()
    # Packed as itself, the output would refer to the node that saved it: alive after the failure.
    assert kept[0]() is None and saved.bytes > 0


def test_meter_memory_after_phases_grows_with_what_is_allocated_and_the_rate_is_measured():
    meter = Meter(torch.device("cpu"))
    meter.after("model")
    keep = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    meter.after("data")
    figures = meter.result()
    assert figures["memory_kind"] == "cpu_rss"
    assert figures["memory_after_data_gib"] - figures["memory_after_model_gib"] > 0.05
    meter.start_timing(0)
    time.sleep(0.2)
    assert 150 < meter.end_window(10, 4) < 250  # 10 steps of 4 samples in about 0.2 s
    meter.stop_timing(10, 4)
    figures = meter.result()
    assert 0.19 < figures["timed_s"] < 1 and figures["samples_per_s"] > 0
    assert figures["peak_allocated_gib"] >= figures["memory_after_data_gib"] - 0.01
    del keep


def test_diagnostics_mark_phases_and_time_the_training_thread():
    diagnostics = Diagnostics()
    diagnostics.mark("model_build")
    diagnostics.start_timed()
    busy_until = time.thread_time() + 0.2
    while time.thread_time() < busy_until:
        pass
    time.sleep(0.1)
    diagnostics.stop_timed()
    figures = diagnostics.result()
    assert figures["model_build_at"] <= figures["warmed_up_at"] < figures["finished_at"]
    assert 0.19 < figures["timed_thread_cpu_s"] < figures["finished_at"] - figures["warmed_up_at"]
    assert figures["timed_voluntary_switches"] >= 1  # the sleep
    assert figures["process_started_at"] < figures["model_build_at"]
