"""Helpers shared by the tests."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

REPO = Path(__file__).resolve().parent.parent


def run_script(*args, devices: int = 1, timeout: int = 300, env_extra=None):
    """Run `python <args>` from the repo root in a fresh process (fake CPU devices if asked)."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def checkpoint_leaves(run_dir) -> dict[str, np.ndarray]:
    """All arrays of the latest checkpoint in a run directory, by leaf index."""
    checkpoints = sorted((Path(run_dir) / "checkpoints").glob("update_*"))
    assert checkpoints, f"no checkpoint in {run_dir}"
    return ocp.PyTreeCheckpointer().restore(str(checkpoints[-1].resolve()))["leaves"]
