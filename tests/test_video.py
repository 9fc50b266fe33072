"""--capture-video: a GIF of one greedy episode after training, or one line where gymnax has no
renderer."""

import json
import os

from PIL import Image

from tests.helpers import run_script


def test_minatar_episode_gif_is_written(tmp_path, tiny_ppo_args):
    args = [a if a != "CartPole" else "Breakout" for a in tiny_ppo_args]
    result = run_script("purejaxrl_ppo.py", *args, "--capture-video")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = result.stdout.strip().splitlines()[-1].split("-> ")[-1]
    gif = os.path.join(run_dir, "videos", "final.gif")
    with Image.open(gif) as image:
        assert image.format == "GIF" and image.n_frames > 1
    assert not os.path.exists(gif + ".tmp.gif")


def reject_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_env_without_renderer_gets_a_notice(tmp_path):
    result = run_script(
        "purejaxrl_dqn.py", "--env", "DeepSea", "--total-timesteps", "400",
        "--learning-starts", "100", "--buffer-size", "200", "--batch-size", "8",
        "--eval-episodes", "0", "--capture-video", "--no-progress",
        "--runs-dir", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gymnax has no renderer for DeepSea-bsuite" in result.stdout
    run_dir = result.stdout.strip().splitlines()[-1].split("-> ")[-1]
    assert not os.path.exists(os.path.join(run_dir, "videos"))
    # No evaluation episodes: the missing returns are null, and summary.json stays strict JSON.
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f, parse_constant=reject_constant)
    assert summary["eval_return_per_seed"] == [None] and summary["eval_return_mean"] is None
