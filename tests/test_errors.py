"""Bad input: one clear sentence, exit code 2, nothing compiled, nothing existing touched."""

import os
import re

import pytest

from purejaxrl_ppo import PRESETS, Config, make_train, validate
from tests.helpers import run_script
from utils.cli import parse_config
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
    expect_config_error(
        [*tiny_ppo_args, "--checkpoint-every", "-1"], "--checkpoint-every must be >= 0"
    )
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
    assert "--learning-rate=0.1 conflicts with 0.004 saved in" in result.stderr
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


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            '{"env": "CartPole", "num_en',
            r"config\.json is not valid JSON \(Unterminated string .*\)$",
        ),
        ("not json", r"config\.json is not valid JSON"),
        ("[1, 2]", r"config\.json holds a JSON list, not an object"),
        ("\udcff", r"config\.json is not valid JSON"),  # bytes that are not UTF-8
    ],
)
def test_resume_of_a_damaged_config_json_is_one_sentence(tmp_path, text, match):
    """A ConfigError, which the command line prints as one line with exit code 2."""
    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    before = (tmp_path / "config.json").stat().st_mtime_ns
    with pytest.raises(ConfigError) as error:
        parse_config(Config, PRESETS, ["--resume", str(tmp_path)])
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"--resume: {tmp_path / 'config.json'} ")
    assert re.search(match, line), line
    assert os.listdir(tmp_path) == ["config.json"]
    assert (tmp_path / "config.json").stat().st_mtime_ns == before
