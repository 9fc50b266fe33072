"""The driver end to end: run directory, reproducibility across seeds, resume, checkpoints."""

import csv
import json
import os

import numpy as np
import pytest

from purejaxrl_ppo import PRESETS, Config, make_train
from tests.helpers import (
    assert_identical_runs,
    checkpoint_leaves,
    metric_table,
    run_script,
)
from utils import checkpoint, driver
from utils.cli import parse_config
from utils.driver import auto_updates_per_chunk, run_training


def train(args):
    return run_training(parse_config(Config, PRESETS, args), make_train)


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


def test_run_directory_has_every_output(tiny_ppo_args):
    summary = train([*tiny_ppo_args, "--num-seeds", "2"])
    run_dir = summary["run_dir"]
    assert os.path.basename(run_dir).startswith("CartPole-v1__ppo__1__")
    assert sorted(os.listdir(run_dir)) == [
        "checkpoints",
        "config.json",
        "learning_curve.png",
        "metrics.csv",
        "summary.json",
    ]
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["update_00000008"]
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["num_envs"] == 4
    rows = read_rows(run_dir)
    assert len(rows) == 8 * 2  # updates x seeds
    assert [int(r["env_steps"]) for r in rows[::2]] == [64 * u for u in range(1, 9)]
    for column in ("episode_return", "episode_length", "policy_loss", "value_loss", "entropy"):
        assert column in rows[0]
    assert {"approx_kl", "clip_frac", "episodes"} <= set(rows[0])
    with open(os.path.join(run_dir, "summary.json")) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(summary))
    assert len(saved["final_return_per_seed"]) == 2 and len(saved["eval_return_per_seed"]) == 2
    for key in ("steps_per_second", "compile_seconds", "wall_seconds", "train_seconds"):
        assert saved[key] > 0
    assert saved["env_steps_per_seed"] == 512 and saved["num_devices"] == 1
    assert os.path.getsize(os.path.join(run_dir, "learning_curve.png")) > 1000


def test_same_seed_same_numbers(tiny_ppo_args):
    assert_identical_runs(train(tiny_ppo_args)["run_dir"], train(tiny_ppo_args)["run_dir"])


def test_interrupted_and_resumed_equals_uninterrupted(tiny_ppo_args, monkeypatch):
    uninterrupted = train(tiny_ppo_args)["run_dir"]

    def interrupt_after_update_4(self, done, *_):
        if done == 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(driver._Progress, "update", interrupt_after_update_4)
        with pytest.raises(SystemExit) as exit_info:
            train(tiny_ppo_args)
    assert exit_info.value.code == 130
    runs_dir = os.path.dirname(uninterrupted)
    (interrupted,) = [d for d in os.listdir(runs_dir) if d != os.path.basename(uninterrupted)]
    interrupted = os.path.join(runs_dir, interrupted)
    assert checkpoint.latest_update(os.path.join(interrupted, "checkpoints")) == 4
    assert not os.path.exists(os.path.join(interrupted, "summary.json"))

    summary = train(["--resume", interrupted, "--no-progress"])
    assert summary["resumed_from_update"] == 4
    a, b = checkpoint_leaves(uninterrupted), checkpoint_leaves(interrupted)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    np.testing.assert_array_equal(metric_table(uninterrupted, 0), metric_table(interrupted, 0))


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    state = {"w": np.arange(3.0)}
    checkpoint.save(str(tmp_path), 1, state, {"update": 1})

    def crash(self, path, *args, **kwargs):
        os.makedirs(str(path) + ".orbax-checkpoint-tmp-0")  # a half-written directory
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.ocp.Checkpointer, "save", crash)
    with pytest.raises(OSError):
        checkpoint.save(str(tmp_path), 2, {"w": np.zeros(3)}, {"update": 2})
    assert checkpoint.latest_update(str(tmp_path)) == 1
    restored, meta = checkpoint.restore(str(tmp_path), state)
    np.testing.assert_array_equal(restored["w"], np.arange(3.0))
    assert meta == {"update": 1}


def test_track_logs_to_wandb_offline_without_network(tiny_ppo_args, tmp_path):
    result = run_script(
        "purejaxrl_ppo.py",
        *tiny_ppo_args,
        "--track",
        env_extra={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    offline_runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline_runs, os.listdir(run_dir)


@pytest.mark.parametrize(
    ("num_updates", "expected"), [(1, 1), (24, 1), (976, 61), (1220, 61), (1000, 40), (997, 40)]
)
def test_auto_chunk_length_divides_when_it_can(num_updates, expected):
    assert auto_updates_per_chunk(num_updates) == expected
