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
