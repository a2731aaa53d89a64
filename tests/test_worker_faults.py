"""What a rank's failure makes of its trial's row, without Ray: the rank raises as it would under a Ray
Train worker, and the row is made by the code the Ray path uses (ray_zero.rows.failed_row_fields). The
same through Ray Tune (a sweep that goes on, a killed worker retried): tests/test_faults.py."""

from __future__ import annotations

from rank_group import experiment_of, trial_spec

from ray_zero.config import Point


def _spec(*overrides: str, point=Point("deepspeed", 1, 64, 1)):
    return trial_spec(experiment_of("experiments/quick.yaml", "steps=4", "warmup_steps=1", *overrides), point)


def test_out_of_memory_becomes_an_oom_row_with_the_memory_at_the_failure(ranks):
    # The injected error is torch.cuda.OutOfMemoryError, the type the rank catches on GPUs.
    row = ranks(1).row(_spec("fault={kind: oom, step: 2}"))
    assert row["status"] == "oom", row["error"]
    assert row["error"].startswith("rank 0 out of memory during step 2: peak allocated")
    assert row["peak_allocated_gib_max"] > 0.1 and row["peak_reserved_gib_max"] > 0.1  # the resident set then
    assert row["measured_over_predicted"] is None  # the peak was not reached


def test_another_error_becomes_a_failed_row_naming_the_rank(ranks):
    row = ranks(1).row(_spec("fault={kind: error, step: 1}"))
    assert row["status"] == "failed" and row["error"].startswith("rank 0: injected error")


def test_a_micro_batch_larger_than_the_ranks_shard_is_a_failed_row_saying_so(ranks):
    row = ranks(1).row(_spec("steps=null", "epochs=1", point=Point("deepspeed", 0, 8192, 1)))
    assert row["status"] == "failed" and "is more than this rank's 5000 samples" in row["error"], row["error"]


def test_the_rank_after_a_failure_trains_again(ranks):
    group = ranks(1)
    assert group.row(_spec("fault={kind: error, step: 0}"))["status"] == "failed"
    starts = group.starts
    row = group.row(_spec())
    assert row["status"] == "ok" and row["loss_last"] < row["loss_first"]
    assert group.starts == starts  # one rank has no peer left waiting: the same process trains the next spec


def test_a_failure_of_ray_trains_controller_is_a_failed_row_naming_its_cause():
    # Ray Train's ControllerError says "Training failed due to controller error:" and its cause on the next
    # line; the row once kept only the first line (a CI run's row read just that).
    from ray.exceptions import RayActorError
    from ray.train import ControllerError

    from ray_zero.run.trial import failure_fields

    cause = RuntimeError("worker group not started: port 123 in use\nmore detail")
    row = failure_fields(ControllerError(cause))
    assert row == {
        "status": "failed",
        "error": "Ray Train's controller failed: RuntimeError: worker group not started: port 123 in use",
    }
    assert failure_fields(ControllerError(RayActorError()))["error"].startswith(
        "Ray Train's controller failed: RayActorError"
    )
