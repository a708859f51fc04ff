from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis profiles: fast by default, exhaustive with CKPT_ENGINE_HYPOTHESIS=thorough.
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("CKPT_ENGINE_HYPOTHESIS", "ci"))

torch.set_num_threads(1)
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


@pytest.fixture
def save_dir(tmp_path):
    return str(tmp_path / "checkpoints")
