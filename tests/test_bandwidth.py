"""`python -m ray_zero bandwidth` at the rank level (tests/README.md): the collectives measured on 2 gloo
ranks, the file they make read back by `estimate`'s reader, and the CLI's lines where nothing is measured
(one worker, bad input) with Ray never imported. The Ray run itself is not in the suite: a TorchTrainer run
costs 20-45 s here, and it is the sweep's, tested there."""

from __future__ import annotations

import itertools
import json
import math
import sys

import pytest

from ray_zero.__main__ import main
from ray_zero.config import ConfigError
from ray_zero.measure.bandwidth import MEASURED, bus_factor, read_bandwidth
from ray_zero.run.bandwidth import bandwidth_file, message_sizes, settle_workers, write_bandwidth_file
from ray_zero.run.plan import Cluster

SIZES = [4096 * 2**k for k in range(5)]  # 4 KiB to 64 KiB: milliseconds on gloo


def measure_on_rank(rank: int, world_size: int, sizes: list[int], **settings) -> list[dict]:
    import torch

    from ray_zero.train.collective_bench import measure_collectives

    return measure_collectives(torch.device("cpu"), sizes, **settings)


@pytest.fixture(scope="module")
def measured(ranks) -> list[list[dict]]:
    """Each of 2 ranks' rows, a few calls per size."""
    return ranks(2).call(measure_on_rank, SIZES, iterations=4, warmup=1)


def test_every_collective_and_size_is_timed_alike_on_every_rank(measured):
    first, second = measured
    assert first == second  # the slowest rank's time, on both
    assert [(r["collective"], r["bytes"]) for r in first] == list(itertools.product(MEASURED, SIZES))
    for row in first:
        assert row["time_s"] > 0 and 1 <= row["iterations"] <= 4
        assert math.isclose(row["algbw_gbps"], row["bytes"] / row["time_s"] / 1e9)
        assert math.isclose(row["busbw_gbps"], row["algbw_gbps"] * bus_factor(row["collective"], 2))


def test_calls_are_cut_to_the_time_bound_alike_on_every_rank(ranks):
    # A bound no call fits in: one timed call per size, on both ranks (a rank doing more would hang).
    rows = ranks(2).call(measure_on_rank, SIZES[:2], iterations=50, warmup=1, seconds_per_size=1e-9)
    assert {row["iterations"] for rank_rows in rows for row in rank_rows} == {1}


def test_the_file_reads_back_as_estimates_bandwidth(measured, tmp_path):
    rows = measured[0]
    content = bandwidth_file(rows, 2, "gloo", "2 CPU workers on one node", "python -m ray_zero bandwidth")
    path = write_bandwidth_file(tmp_path / "sub" / "bw.json", content)
    assert json.loads(path.read_text())["versions"].keys() == {"python", "torch", "ray"}
    bandwidth = read_bandwidth(path)
    assert "2 workers, gloo, 2 CPU workers on one node" in bandwidth.source
    for row in rows:
        assert math.isclose(bandwidth.busbw(row["collective"], row["bytes"]), row["busbw_gbps"])


def test_sizes_and_the_worker_count_follow_the_cluster():
    assert message_sizes(1, 1024) == [2**k * 2**20 for k in range(11)]
    assert message_sizes(4, 4) == [4 * 2**20]
    assert settle_workers(None, "auto", Cluster(gpus=8, cpus=64, source="a node")) == (8, True)
    assert settle_workers(None, "auto", Cluster(gpus=0, cpus=2, source="a laptop")) == (2, False)
    assert settle_workers(None, "cpu", Cluster(gpus=8, cpus=64, source="a node")) == (2, False)
    assert settle_workers(None, "auto", Cluster(gpus=1, cpus=8, source="a node")) == (1, True)
    with pytest.raises(ConfigError, match="has 2 CPUs, one a worker; give 2$"):
        settle_workers(3, "cpu", Cluster(gpus=0, cpus=2, source="this machine"))
    with pytest.raises(ConfigError, match="has 1 GPUs; give --device cpu for CPU workers"):
        settle_workers(2, "auto", Cluster(gpus=1, cpus=8, source="a node"))
    with pytest.raises(ConfigError, match="--device gpu: this machine has no GPU"):
        settle_workers(2, "gpu", Cluster(gpus=0, cpus=2, source="this machine"))


@pytest.fixture
def no_ray(monkeypatch):
    """`import ray` fails while the test runs: what passes never reached Ray."""
    monkeypatch.setitem(sys.modules, "ray", None)


def test_one_worker_says_there_is_nothing_to_measure(no_ray, tmp_path, capsys):
    output = tmp_path / "bw.json"
    assert main(["bandwidth", "--workers", "1", "--output", str(output)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == "ray_zero: bandwidth: 1 worker has no peer: nothing to measure (give --workers 2 or more)"
    assert not output.exists()


@pytest.mark.parametrize(
    "arguments, says",
    [
        (["--min-mib", "0"], "--min-mib: give a power of two of MiB (1, 2, 4, ..., 1024), not 0"),
        (["--max-mib", "48"], "--max-mib: give a power of two of MiB"),
        (["--min-mib", "8", "--max-mib", "4"], "--min-mib 8 is above --max-mib 4: give min <= max"),
        (["--workers", "0"], "--workers: give a whole number of workers, 1 or more, not 0"),
        (["--device", "tpu"], "--device: give one of auto, gpu, cpu, not 'tpu'"),
        (["--iterations", "0"], "--iterations: give a whole number of timed calls, 1 or more"),
    ],
)
def test_bad_input_is_one_line_naming_what_is_allowed(no_ray, capsys, arguments, says):
    assert main(["bandwidth", *arguments]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("ray_zero: error: ") and says in captured.err
    assert captured.err.count("\n") == 1 and not captured.out
