"""--sweep: hyperparameter configurations x seeds in one compiled program."""

import csv
import dataclasses
import json
import os

import numpy as np
import pytest

import purejaxrl_dqn
import purejaxrl_ppo
from tests.helpers import TINY_DQN, assert_seed_matches_single_run, checkpoint_leaves, metric_table
from utils.cli import parse_config
from utils.driver import run_training
from utils.errors import ConfigError
from utils.sweep import config_label, num_configs, sweep_configs


def ppo(args):
    return run_training(
        parse_config(purejaxrl_ppo.Config, purejaxrl_ppo.PRESETS, args),
        purejaxrl_ppo.make_train,
        purejaxrl_ppo.validate,
    )


def test_configurations_are_the_product_with_typed_values():
    config = purejaxrl_dqn.Config(
        sweep=("lr=1e-3,3e-4", "--target-network-frequency=100,200.0", "gamma=0.9")
    )
    configs = sweep_configs(config, purejaxrl_dqn.HyperParams._fields)
    assert num_configs(config.sweep) == len(configs) == 4
    assert configs[1] == {"learning_rate": 1e-3, "target_network_frequency": 200, "gamma": 0.9}
    assert isinstance(configs[1]["target_network_frequency"], int)
    assert config_label(configs[2]) == "learning_rate=0.0003 target_network_frequency=100 gamma=0.9"
    assert sweep_configs(purejaxrl_dqn.Config(), purejaxrl_dqn.HyperParams._fields) == [{}]


@pytest.mark.parametrize(
    "sweep, message",
    [
        (["num_envs=4,8"], "shapes the compiled program"),
        (["double_dqn=0,1"], "shapes the compiled program"),
        (["lrate=1,2"], "not a flag of this trainer"),
        (["learning_starts=10.5"], "not an integer"),
        (["gamma=0.9,high"], "not a number"),
        (["gamma"], "NAME=V1,V2"),
        (["gamma=,"], "NAME=V1,V2"),
        (["gamma=0.9", "gamma=0.99"], "given twice"),
        (["gamma=0.9,0.9"], "repeated"),
        (["gamma=0.9,1.5"], "--gamma must be a finite number in [0, 1], got 1.5"),
    ],
)
def test_bad_sweeps_are_refused_before_compiling(tmp_path, sweep, message):
    args = [*TINY_DQN, "--no-progress", "--runs-dir", str(tmp_path), "--sweep", *sweep]
    config = parse_config(purejaxrl_dqn.Config, purejaxrl_dqn.PRESETS, args)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_training(config, purejaxrl_dqn.make_train, purejaxrl_dqn.validate)
    assert not os.path.exists(tmp_path / "runs")  # nothing written


def test_sweepable_names_are_listed():
    config = purejaxrl_ppo.Config(sweep=("hidden_size=32,64",))
    with pytest.raises(ConfigError, match="sweepable: learning_rate, gamma, gae_lambda"):
        sweep_configs(config, purejaxrl_ppo.HyperParams._fields)


def test_sweep_configuration_equals_a_single_run(tiny_ppo_args):
    sweep = ppo([*tiny_ppo_args, "--sweep", "lr=1e-3,3e-4", "vf-coef=0.5,1", "--num-seeds", "2"])
    # configuration 2 (learning rate 3e-4, vf_coef 0.5), seed index 1, is run 2 * 2 + 1
    alone = ppo([*tiny_ppo_args, "--learning-rate", "3e-4", "--vf-coef", "0.5", "--seed", "2"])
    assert_seed_matches_single_run(sweep, 5, alone)
    run_dir = sweep["run_dir"]
    assert not np.allclose(metric_table(run_dir, 0, 2), metric_table(run_dir, 1, 2))
    params = checkpoint_leaves(run_dir)["00000"]  # [devices, runs, ...]
    assert not np.allclose(params[:, 4], params[:, 5])  # seeds are independent

    assert sweep["seeds"] == [1, 2] * 4
    ranking = sweep["sweep"]["ranking"]
    assert sweep["sweep"]["parameters"] == ["learning_rate", "vf_coef"]
    assert sorted(r["config"] for r in ranking) == [0, 1, 2, 3]
    means = [r["final_mean"] for r in ranking]
    assert means == sorted(means, reverse=True)
    third = next(r for r in ranking if r["config"] == 2)
    assert third["hyperparams"] == {"learning_rate": 3e-4, "vf_coef": 0.5}
    assert third["final_per_seed"] == sweep["final_per_seed"][4:6]
    with open(os.path.join(sweep["run_dir"], "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 * 8  # updates x (configurations x seeds)
    assert [(r["config"], r["seed"], r["learning_rate"], r["vf_coef"]) for r in rows[4:6]] == [
        ("2", "0", "0.0003", "0.5"),
        ("2", "1", "0.0003", "0.5"),
    ]


def test_resume_keeps_the_sweep(tmp_path):
    """config.json stores the sweep as a list; resuming reads it back as the same flag."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    saved = dataclasses.asdict(purejaxrl_ppo.Config(sweep=("lr=1e-3,3e-4",)))
    (run_dir / "config.json").write_text(json.dumps(saved))
    same = ["--resume", str(run_dir), "--sweep", "lr=1e-3,3e-4"]
    config = parse_config(purejaxrl_ppo.Config, purejaxrl_ppo.PRESETS, same)
    assert config.sweep == ("lr=1e-3,3e-4",)
    with pytest.raises(ConfigError, match="--sweep"):
        parse_config(
            purejaxrl_ppo.Config,
            purejaxrl_ppo.PRESETS,
            ["--resume", str(run_dir), "--sweep", "lr=1e-3"],
        )
