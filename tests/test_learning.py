"""Every trainer must learn: short CPU runs that fail if learning breaks."""

import pytest

from tests.helpers import run_script, summary_of_only_run

pytestmark = pytest.mark.slow


def test_ppo_cartpole_reaches_475_within_5e5_steps_on_two_seeds(tmp_path):
    result = run_script(
        "purejaxrl_ppo.py",
        "--env", "CartPole",
        "--num-seeds", "2",
        "--no-progress",
        "--runs-dir", str(tmp_path),
        llvm_level=1,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of_only_run(tmp_path)
    assert summary["env_steps_per_seed"] <= 500_000
    assert min(summary["final_per_seed"]) >= 475, summary["final_per_seed"]
    assert min(summary["eval_return_per_seed"]) >= 475, summary["eval_return_per_seed"]


def test_ppo_on_two_devices_runs_and_learns(tmp_path):
    """Environments split over 2 fake CPU devices, gradients averaged: one agent per seed."""
    result = run_script(
        "purejaxrl_ppo.py",
        "--env", "CartPole",
        "--num-devices", "2",
        "--no-progress",
        "--runs-dir", str(tmp_path),
        devices=2,
        llvm_level=1,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = summary_of_only_run(tmp_path)
    assert summary["num_devices"] == 2
    assert summary["final_per_seed"][0] >= 475, summary


def test_dqn_cartpole_reaches_400_within_2e5_steps_on_two_seeds(tmp_path):
    """DQN's classic preset on a shorter budget (epsilon decays over 1e5 steps)."""
    args = ["--env", "CartPole", "--total-timesteps", "200000", "--num-seeds", "2"]
    result = run_script(
        "purejaxrl_dqn.py", *args, "--no-progress", "--runs-dir", str(tmp_path), llvm_level=1
    )
    assert result.returncode == 0, result.stderr
    summary = summary_of_only_run(tmp_path)
    assert min(summary["final_per_seed"]) >= 400, summary["final_per_seed"]
    assert min(summary["eval_return_per_seed"]) >= 400, summary["eval_return_per_seed"]


def test_az_tic_tac_toe_learns_to_never_lose(tmp_path):
    """The tic_tac_toe preset cut to 30 iterations and evaluated once at the end: no lost game
    against the random player from either seat, and mostly draws against the perfect player."""
    result = run_script(
        "purejaxrl_az.py", "--env", "tic_tac_toe", "--num-iterations", "30", "--eval-every", "30",
        "--no-progress", "--runs-dir", str(tmp_path), timeout=600, llvm_level=1,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    final = summary_of_only_run(tmp_path)["final_metrics_per_seed"][0]
    assert final["eval_random_loss"] == 0.0, final
    assert final["eval_oracle_draw"] >= 0.75, final


# Two runs with the same flags in one process (`python -c ... RUNS_DIR FLAGS...`): purejaxrl_ppo
# as it is into RUNS_DIR/ppo, then with the sign of every advantage flipped in its loss into
# RUNS_DIR/flipped.
PPO_AND_PPO_WITH_FLIPPED_ADVANTAGES = """
import sys
import purejaxrl_ppo
from utils.cli import parse_config
from utils.driver import run_training

runs_dir, flags = sys.argv[1], sys.argv[2:]

def train(name, *more_flags):
    args = [*flags, *more_flags, "--runs-dir", f"{runs_dir}/{name}"]
    config = parse_config(purejaxrl_ppo.Config, purejaxrl_ppo.PRESETS, args)
    run_training(config, purejaxrl_ppo.make_train, purejaxrl_ppo.validate)

train("ppo")
ppo_loss = purejaxrl_ppo.ppo_loss

def flipped(log_prob, entropy, value, old_log_prob, old_value, advantages, targets, **kwargs):
    minibatch = (log_prob, entropy, value, old_log_prob, old_value, -advantages, targets)
    return ppo_loss(*minibatch, **kwargs)

purejaxrl_ppo.ppo_loss = flipped
train("flipped", "--eval-episodes", "0")
"""


def test_ppo_pendulum_reaches_minus_500_within_2_6e5_steps_and_not_with_flipped_advantages(
    tmp_path,
):
    """Continuous PPO: the continuous preset with gamma 0.9 and learning rate 3e-3 learns
    Pendulum in 128 updates, 262,144 steps (a random policy scores about -1200 to -1500; 16 seeds
    of this run ended between -360 and -170, their greedy evaluations between -350 and -130).
    The same run with the advantages' sign flipped must stay below the threshold: it cannot be
    met without the policy gradient. One chunk: compiling, not training, is most of the time."""
    result = run_script(
        "-c", PPO_AND_PPO_WITH_FLIPPED_ADVANTAGES, str(tmp_path),
        "--env", "Pendulum", "--gamma", "0.9", "--learning-rate", "3e-3",
        "--total-timesteps", "262144", "--updates-per-chunk", "128", "--no-progress",
        llvm_level=1,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    ppo, flipped = (summary_of_only_run(tmp_path / name) for name in ("ppo", "flipped"))
    assert ppo["env_steps_per_seed"] == flipped["env_steps_per_seed"] == 262_144
    assert ppo["final_per_seed"][0] >= -500, ppo["final_per_seed"]
    assert ppo["eval_return_per_seed"][0] >= -600, ppo["eval_return_per_seed"]
    assert flipped["final_per_seed"][0] < -500, flipped["final_per_seed"]
