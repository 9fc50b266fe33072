"""Env aliases, presets and flag parsing."""

import dataclasses

import pytest

from purejaxrl_ppo import PRESETS, Config
from tests.helpers import run_script
from utils.cli import parse_config
from utils.envs import env_family, make_env, resolve_env_id
from utils.errors import ConfigError
from utils.logs import write_json


@pytest.mark.parametrize(
    ("name", "env_id"),
    [
        ("CartPole", "CartPole-v1"),
        ("cartpole", "CartPole-v1"),
        ("Breakout", "Breakout-MinAtar"),
        ("SpaceInvaders", "SpaceInvaders-MinAtar"),
        ("Seaquest", "Seaquest-MinAtar"),
        ("Pendulum", "Pendulum-v1"),
        ("Breakout-MinAtar", "Breakout-MinAtar"),
        ("catch-bsuite", "Catch-bsuite"),
    ],
)
def test_aliases_resolve_to_gymnax_ids(name, env_id):
    assert resolve_env_id(name) == env_id


def test_unknown_env_lists_aliases_and_ids():
    with pytest.raises(ConfigError) as error:
        resolve_env_id("Pong-ALE")
    message = str(error.value)
    assert "'Pong-ALE'" in message
    assert "Breakout (Breakout-MinAtar)" in message and "Acrobot-v1" in message


def test_env_spec_and_families():
    _, _, spec = make_env("Breakout")
    assert spec.obs_shape == (10, 10, 4) and spec.discrete and spec.num_actions == 3
    _, _, spec = make_env("Pendulum")
    assert not spec.discrete and spec.num_actions == 1 and spec.max_episode_steps == 200
    assert [env_family(resolve_env_id(n)) for n in ("Asterix", "Pendulum", "Acrobot")] == [
        "minatar",
        "continuous",
        "classic",
    ]


def test_preset_defaults_and_overrides():
    config = parse_config(Config, PRESETS, ["--env", "Breakout"])
    assert config.num_envs == PRESETS["minatar"]["num_envs"]
    assert config.total_timesteps == PRESETS["minatar"]["total_timesteps"]
    # Breakout-MinAtar's own entry refines the family's; other MinAtar games keep the family's
    assert config.shared_torso and config.learning_rate == 5e-3
    config = parse_config(Config, PRESETS, ["--env", "Asterix"])
    assert config.num_envs == PRESETS["minatar"]["num_envs"]
    assert not config.shared_torso and config.learning_rate == PRESETS["minatar"]["learning_rate"]
    config = parse_config(Config, PRESETS, ["--env", "Breakout-MinAtar", "--no-shared-torso"])
    assert not config.shared_torso and config.learning_rate == 5e-3
    config = parse_config(Config, PRESETS, ["--env=Breakout", "--num-envs", "8", "--no-anneal-lr"])
    assert config.num_envs == 8 and not config.anneal_lr
    config = parse_config(Config, PRESETS, ["--num_seeds", "3", "--learning-rate", "1e-3"])
    assert config.env == "CartPole" and config.num_seeds == 3 and config.learning_rate == 1e-3


def test_an_envs_own_preset_refines_its_familys():
    presets = {"minatar": {"num_envs": 8, "ent_coef": 0.5}, "Breakout-MinAtar": {"num_envs": 4}}
    config = parse_config(Config, presets, ["--env", "Breakout"])
    assert (config.num_envs, config.ent_coef) == (4, 0.5)
    config = parse_config(Config, presets, ["--env", "Asterix"])
    assert (config.num_envs, config.ent_coef) == (8, 0.5)
    config = parse_config(Config, presets, ["--env", "Breakout-MinAtar", "--num-envs", "2"])
    assert (config.num_envs, config.ent_coef) == (2, 0.5)


def test_help_names_every_flag_and_says_breakout_is_minatar():
    result = run_script("purejaxrl_ppo.py", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "MinAtar" in text and "not ALE" in text
    flags = "--seed --total-timesteps --learning-rate --num-envs --num-steps --num-minibatches"
    flags += " --update-epochs --gamma --gae-lambda --clip-coef --ent-coef --vf-coef"
    flags += " --max-grad-norm --anneal-lr --track --wandb-project-name --wandb-entity"
    flags += " --num-seeds --num-devices --resume --no-progress --eval-episodes"
    flags += " --allow-nonfinite"
    for flag in flags.split():
        assert flag in text, flag
    assert "exits with code 3" in text and "reevaluate" not in text  # set by --resume, not a flag


def test_an_evaluation_size_given_with_resume_asks_for_a_new_evaluation(tmp_path):
    write_json(str(tmp_path / "config.json"), dataclasses.asdict(Config(eval_episodes=4)))
    resume = ["--resume", str(tmp_path)]
    assert not parse_config(Config, PRESETS, resume).reevaluate
    for flag in ("--eval-episodes=4", "--eval_episodes=4"):  # the saved value, asked again
        config = parse_config(Config, PRESETS, [*resume, flag])
        assert config.reevaluate and config.eval_episodes == 4
    assert not parse_config(Config, PRESETS, ["--eval-episodes", "4"]).reevaluate  # a new run
