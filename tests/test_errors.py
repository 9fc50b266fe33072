"""Bad input: one clear sentence, exit code 2, nothing compiled, nothing existing touched."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from purejaxrl_ppo import PRESETS, Config, make_train, validate
from tests.helpers import REPO, run_script
from utils.cli import parse_config
from utils.devices import xla_flags_with_cpu_devices
from utils.driver import run_training
from utils.errors import ConfigError
from utils.trainer import Runtime


def expect_config_error(args, match):
    with pytest.raises(ConfigError, match=match):
        run_training(parse_config(Config, PRESETS, args), make_train, validate)


def test_unknown_env_exits_2_with_the_valid_names():
    result = run_script("purejaxrl_ppo.py", "--env", "Pong-ALE")
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown env 'Pong-ALE'")
    assert "Breakout (Breakout-MinAtar)" in result.stderr and "CartPole-v1" in result.stderr
    assert "Traceback" not in result.stderr


def test_num_envs_not_divisible_by_devices(tmp_path):
    result = run_script(
        "purejaxrl_ppo.py", "--num-envs", "3", "--runs-dir", str(tmp_path), devices=2
    )
    assert result.returncode == 2
    assert "--num-envs 3 is not divisible by the 2 devices" in result.stderr
    assert not os.listdir(tmp_path)


def test_batch_not_divisible_by_minibatches(tiny_ppo_args, tmp_path):
    expect_config_error(
        [*tiny_ppo_args, "--num-steps", "5", "--num-minibatches", "3"],
        r"rollout batch per device \(4 envs x 5 steps = 20\) is not divisible by --num-minibatches 3",
    )
    assert not (tmp_path / "runs").exists()


def test_total_timesteps_below_one_update(tiny_ppo_args):
    expect_config_error([*tiny_ppo_args, "--total-timesteps", "63"], "less than one update")


def test_too_many_devices(tiny_ppo_args):
    expect_config_error([*tiny_ppo_args, "--num-devices", "64"], "more devices than the 1")


def test_sizes_out_of_range(tiny_ppo_args):
    expect_config_error([*tiny_ppo_args, "--num-seeds", "0"], "--num-seeds must be >= 1")
    expect_config_error([*tiny_ppo_args, "--update-epochs", "0"], "--update-epochs must be >= 1")
    # beyond a 32-bit integer, JAX's tracing of the network would overflow
    expect_config_error(
        [*tiny_ppo_args, "--hidden-size", str(2**31)], "--hidden-size must be <= 2147483647"
    )
    # no step counter of PPO holds the total, so it may be larger
    validate(parse_config(Config, PRESETS, ["--total-timesteps", str(10**10)]), Runtime())


def test_resume_of_a_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(Config, PRESETS, ["--resume", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match=r"no config\.json"):
        parse_config(Config, PRESETS, ["--resume", str(tmp_path)])


def test_resume_with_a_conflicting_flag_leaves_the_run_untouched(tiny_ppo_args):
    summary = run_training(parse_config(Config, PRESETS, tiny_ppo_args), make_train, validate)
    run_dir = summary["run_dir"]

    def snapshot():
        return {
            os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
            for root, _, names in os.walk(run_dir)
            for name in names
        }

    before = snapshot()
    result = run_script("purejaxrl_ppo.py", "--resume", run_dir, "--learning-rate", "0.1")
    assert result.returncode == 2
    assert "--learning-rate=0.1 conflicts with 0.00025 saved in" in result.stderr
    assert snapshot() == before


def test_cnn_torso_needs_image_observations(tiny_ppo_args):
    expect_config_error([*tiny_ppo_args, "--torso", "cnn"], "needs image observations")


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (
            ["--learning-rate", "nan"],
            r"--learning-rate must be a finite number in \(0, 1\], got nan",
        ),
        (["--learning-rate", "-1"], r"--learning-rate must be a finite number in \(0, 1\]"),
        (["--learning-rate", "inf"], "got inf"),
        (["--gamma", "5"], r"--gamma must be a finite number in \[0, 1\], got 5.0"),
        (["--clip-coef", "-1"], r"--clip-coef must be a finite number in \[0, inf\)"),
        (["--ent-coef", "nan"], "--ent-coef must be a finite number"),
        (["--max-grad-norm", "1e300"], "--max-grad-norm 1e[+]300 is beyond float32"),
        (["--sweep", "lr=nan,1e-3"], "--learning-rate must be a finite number"),
        (["--eval-episodes", "-1"], "--eval-episodes must be >= 0"),
        (["--seed", "100000000000000000000"], r"seeds must lie in \[0, 2147483647\]"),
        (["--num-seeds", "10000000"], r"needs about [\d,.]+ GiB \(.* x 10000000 runs\)"),
    ],
)
def test_float_flags_are_checked_nan_and_inf_included(tiny_ppo_args, flags, match):
    expect_config_error([*tiny_ppo_args, *flags], match)
    assert not os.path.exists(tiny_ppo_args[-1])  # nothing written


def test_sigterm_saves_a_checkpoint_and_the_run_resumes(tmp_path):
    """What SLURM and Kubernetes send before a kill: a checkpoint at the chunk boundary, one line
    that says how to resume, exit code 130; the resume then finishes the run."""
    runs = tmp_path / "runs"
    args = ["--env", "CartPole", "--num-envs", "4", "--num-steps", "16", "--num-minibatches", "2"]
    args += ["--total-timesteps", "6400", "--updates-per-chunk", "1", "--eval-episodes", "0"]
    args += ["--no-progress", "--runs-dir", str(runs)]
    env = {**os.environ, "XLA_FLAGS": xla_flags_with_cpu_devices(1)}
    process = subprocess.Popen(
        [sys.executable, "purejaxrl_ppo.py", *args], cwd=REPO, env=env, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 120
    while not list(runs.glob("*/checkpoints/update_*")) and time.monotonic() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    stderr = stderr.decode()
    assert process.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr and "continue with --resume" in stderr
    run_dir = stderr.strip().split("--resume ")[-1]
    resumed = run_script(
        "purejaxrl_ppo.py", "--resume", run_dir, "--no-progress", "--updates-per-chunk", "100"
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    with open(os.path.join(run_dir, "summary.json")) as f:
        assert json.load(f)["resumed_from_update"] > 0
