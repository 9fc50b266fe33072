import os

import pytest

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "disabled")


@pytest.fixture
def tiny_ppo_args(tmp_path):
    """A PPO CartPole run of 8 updates in 4 chunks: compiles in seconds, runs in a blink."""
    return [
        "--env", "CartPole",
        "--num-envs", "4",
        "--num-steps", "16",
        "--num-minibatches", "2",
        "--update-epochs", "2",
        "--total-timesteps", "512",
        "--updates-per-chunk", "2",
        "--eval-episodes", "2",
        "--no-progress",
        "--runs-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
