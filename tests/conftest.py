"""Tests run JAX on 8 fake CPU devices; the flag must be set before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run, so a red CI run is reproducible;
# HYPOTHESIS_PROFILE=explore draws fresh ones (and remembers failures) for a hunt.
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ROOT = Path(__file__).resolve().parents[1]
IOPDDL_DIR = ROOT.parent / "shared" / "iopddl"


@pytest.fixture(scope="session")
def models_dir() -> Path:
    return ROOT / "models"
