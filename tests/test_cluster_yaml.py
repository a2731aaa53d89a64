"""cluster.yaml stays a valid Ray cluster launcher config (checked with the autoscaler's own schema)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster_config():
    return yaml.safe_load((ROOT / "cluster.yaml").read_text())


def _validate(config):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(config)))


def test_cluster_yaml_passes_rays_schema(cluster_config):
    _validate(cluster_config)
    gpu_types = [n for n in cluster_config["available_node_types"].values() if n["max_workers"] > 0]
    assert gpu_types, "an autoscaling worker node type"
    assert any("requirements.txt" in c for c in cluster_config["setup_commands"])
    assert "." in cluster_config["file_mounts"].values()
    assert "--dashboard-host=127.0.0.1" in " ".join(cluster_config["head_start_ray_commands"])


def test_the_validator_would_catch_a_broken_file(cluster_config):
    from jsonschema.exceptions import ValidationError

    broken = copy.deepcopy(cluster_config)
    broken["available_node_types"]["head"]["min_wokers"] = 1
    with pytest.raises(ValidationError, match="min_wokers"):
        _validate(broken)


def test_no_credentials_in_cluster_yaml():
    text = (ROOT / "cluster.yaml").read_text().lower()
    for secret in ("aws_access_key_id", "aws_secret_access_key", "ssh_private_key:", "password", "token:"):
        assert secret not in text
