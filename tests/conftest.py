"""Tests run JAX on 8 fake CPU devices; the flag must be set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IOPDDL_DIR = ROOT.parent / "shared" / "iopddl"


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return ROOT / "models"
