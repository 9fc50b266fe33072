"""Golden runs: tiny fixed-seed runs of every trainer whose numbers are stored under
tests/golden/, so that a change meant to move code and not numbers can prove it.

    python -m tests.golden_runs        # re-record every run (only in a commit that says why)

`tests/test_golden.py` trains the same runs and compares: bit for bit on the CPU and XLA flags
that recorded them, within a tight tolerance elsewhere (XLA:CPU compiles for the host, and
another processor may vectorise, and so round, differently).
"""

from __future__ import annotations

import csv
import importlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from tests.helpers import TINY_AZ, TINY_DQN, TINY_PPO

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
RECORDED = GOLDEN_DIR / "recorded.json"

# name -> (trainer module, flags). Every run uses one device.
# The CartPole and tic_tac_toe runs keep the learning rate they were recorded at when the
# preset moves.
PPO_CARTPOLE = ["--env", "CartPole", *TINY_PPO, "--learning-rate", "2.5e-4"]
DQN_CARTPOLE = [*TINY_DQN, "--learning-rate", "2.5e-4"]
PPO_PENDULUM = ["--env", "Pendulum", *TINY_PPO, "--num-steps", "32", "--total-timesteps", "1024"]
PPO_PENDULUM += ["--updates-per-chunk", "3"]
RUNS = {
    "ppo_cartpole": ("purejaxrl_ppo", PPO_CARTPOLE),
    # 8 updates in chunks of 3, 3 and 2: the last runs the others' program (utils/driver.py)
    "ppo_pendulum": ("purejaxrl_ppo", PPO_PENDULUM),
    "ppo_cartpole_2_seeds": ("purejaxrl_ppo", [*PPO_CARTPOLE, "--num-seeds", "2"]),
    "dqn_cartpole": ("purejaxrl_dqn", DQN_CARTPOLE),
    "dqn_cartpole_sweep": (  # 128 updates in chunks of 12, the last of 8
        "purejaxrl_dqn",
        [*DQN_CARTPOLE, "--sweep", "gamma=0.9,0.99", "--updates-per-chunk", "12"],
    ),
    "az_tic_tac_toe": ("purejaxrl_az", [*TINY_AZ, "--learning-rate", "1e-3"]),
}
# summary.json entries that the run computes (not timings or paths)
SUMMARY_KEYS = ("final_per_seed", "eval_return_per_seed", "final_metrics_per_seed")


def recording_conditions() -> dict:
    """What decides whether a rerun must match bit for bit: the processor XLA compiles for, the
    XLA flags and the versions."""
    import jax

    cpu = platform.processor()
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            first_cpu = f.read().split("\n\n")[0].splitlines()
        info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in first_cpu)}
        cpu = info.get("model name", cpu)
        flags = " ".join(sorted(info.get("flags", "").split()))
    return {
        "cpu": cpu,
        "cpu_flags": flags,
        "machine": platform.machine(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "device_count": jax.local_device_count(),
    }


def train(name: str, runs_dir: str) -> tuple[dict, dict]:
    """Train golden run `name` in this process: (summary, metrics.csv columns as text lists)."""
    from utils.cli import parse_config
    from utils.driver import run_training

    module_name, flags = RUNS[name]
    module = importlib.import_module(module_name)
    extra = {"preset_key": module.resolve_game} if module_name == "purejaxrl_az" else {}
    args = [*flags, "--no-progress", "--runs-dir", runs_dir]
    run_dir = run_training(
        parse_config(module.Config, module.PRESETS, args, **extra),
        module.make_train,
        module.validate,
    )["run_dir"]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    return summary, read_columns(os.path.join(run_dir, "metrics.csv"))


def read_columns(path) -> dict[str, list[str]]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return {name: [row[i] for row in rows[1:]] for i, name in enumerate(rows[0])}


def record() -> None:
    """Train every golden run and store its metrics.csv and summary numbers."""
    from utils.logs import write_json

    GOLDEN_DIR.mkdir(exist_ok=True)
    runs = {}
    with tempfile.TemporaryDirectory() as runs_dir:
        for name in RUNS:
            summary, _ = train(name, runs_dir)
            os.replace(os.path.join(summary["run_dir"], "metrics.csv"), GOLDEN_DIR / f"{name}.csv")
            runs[name] = {
                "flags": RUNS[name][1],
                **{key: summary[key] for key in SUMMARY_KEYS},
            }
            print(f"recorded {name}")
    write_json(str(RECORDED), {"conditions": recording_conditions(), "runs": runs})


if __name__ == "__main__":
    # The test session's conditions (tests/conftest.py): LLVM level 0, JAX's one CPU device.
    # XLA reads XLA_FLAGS when JAX starts its backend, which importing this module (gymnax)
    # has already done: without the flags, the recording restarts in a process that has them.
    from utils.devices import LLVM_LEVEL_FLAG, xla_flags_with

    flags = xla_flags_with(LLVM_LEVEL_FLAG, 0)
    if os.environ.get("XLA_FLAGS") != flags:
        command = [sys.executable, "-m", "tests.golden_runs"]
        os.execve(sys.executable, command, {**os.environ, "XLA_FLAGS": flags})
    os.environ.setdefault("WANDB_MODE", "disabled")
    # Compiled afresh. JAX's cache key hashes XLA_FLAGS as the environment holds them when a
    # program compiles, not as XLA read them at start: a process that set them late (as this
    # recorder once did) stored programs under keys that misdescribe them.
    with tempfile.TemporaryDirectory() as cache:
        import jax

        jax.config.update("jax_compilation_cache_dir", cache)
        record()
