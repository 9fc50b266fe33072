"""The driver and the trainer contract, specified with a stub trainer that compiles in a blink:
run directory, seeds and sweeps side by side, resume, checkpoints, wandb, and the contract's
checks (swept values unreadable to compiled code, the config never mutated)."""

import concurrent.futures
import csv
import dataclasses
import fcntl
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import assert_identical_runs, checkpoint_leaves, metric_table
from utils import checkpoint, driver
from utils.cli import RunConfig
from utils.driver import auto_updates_per_chunk, run_training
from utils.errors import ConfigError
from utils.trainer import (
    Runtime,
    Trainer,
    TrainerContractError,
    build_trainer,
    check_chunk_metrics,
    hyperparams_of,
)

# ---------------------------------------------------------------------------------------------
# The stub: x starts at a random value per seed and moves towards `target` at `rate` per update
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class StubConfig(RunConfig):
    env: str = "stub"
    num_updates: int = 8
    rate: float = 0.5
    target: float = 1.0
    limit: int = 3  # an int hyperparameter
    negative_rate: bool = False  # the validator's one check


class StubHyperParams(NamedTuple):
    rate: jax.Array
    target: jax.Array
    limit: jax.Array


def stub_validate(config, runtime):
    if config.rate < 0 and not config.negative_rate:
        raise ConfigError(f"--rate must be >= 0, got {config.rate}")


def make_stub(read_in_chunk: str | None = None, read_in_build: str | None = None):
    """The stub's make_train; `read_in_*` names a config field that it wrongly reads inside its
    compiled chunk or while it is built."""

    def make_train(config, runtime=None):
        if read_in_build:
            getattr(config, read_in_build)

        def train_chunk(state, num_updates):
            def update(x, _):
                rate = getattr(config, read_in_chunk) if read_in_chunk else state["hp"].rate
                x = x + rate * (state["hp"].target - x)
                return x, {"episode_return": x, "loss": jnp.square(x - state["hp"].target)}

            x, metrics = jax.lax.scan(update, state["x"], None, num_updates)
            return {**state, "x": x}, metrics

        return Trainer(
            algo="stub",
            env_id=config.env,
            num_updates=config.num_updates,
            steps_per_update=10,
            hyperparams=hyperparams_of(StubHyperParams, config),
            init=lambda key, hp: {"x": jax.random.uniform(key), "hp": hp},
            train_chunk=train_chunk,
            evaluate=lambda state, key: jnp.full(2, state["x"]),  # two "episodes"
            runtime=runtime or Runtime(),
        )

    return make_train


def train(tmp_path, make_train=None, **fields):
    config = StubConfig(runs_dir=str(tmp_path / "runs"), progress=False, **fields)
    return run_training(config, make_train or make_stub(), stub_validate)


def read_rows(run_dir):
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------------------------------
# Outputs, seeds, sweeps
# ---------------------------------------------------------------------------------------------


def test_run_directory_has_every_output(tmp_path):
    summary = train(tmp_path, num_seeds=2, updates_per_chunk=4)
    run_dir = summary["run_dir"]
    assert os.path.basename(run_dir).startswith("stub__stub__1__")
    assert sorted(os.listdir(run_dir)) == [
        "checkpoints",
        "config.json",
        "learning_curve.png",
        "metrics.csv",
        "run.json",
        "summary.json",
    ]
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["update_00000008"]
    with open(os.path.join(run_dir, "config.json")) as f:
        assert json.load(f)["num_seeds"] == 2
    rows = read_rows(run_dir)
    assert len(rows) == 8 * 2  # updates x seeds
    assert [int(r["env_steps"]) for r in rows[::2]] == [10 * u for u in range(1, 9)]
    assert list(rows[0]) == ["update", "env_steps", "seed", "episode_return", "loss"]
    with open(os.path.join(run_dir, "summary.json")) as f:
        saved = json.load(f)
    assert saved == json.loads(json.dumps(summary))
    x = np.array([[float(r["episode_return"]) for r in rows[s::2]] for s in range(2)])
    # final: the mean over the last 10% of updates (at least one); eval: the final state's
    assert saved["final_per_seed"] == pytest.approx(x[:, -1].tolist())
    assert saved["eval_return_per_seed"] == pytest.approx(x[:, -1].tolist())
    assert saved["final_metrics_per_seed"][1]["loss"] == pytest.approx(float(rows[-1]["loss"]))
    for key in ("steps_per_second", "compile_seconds", "wall_seconds", "train_seconds"):
        assert saved[key] > 0
    assert saved["env_steps_per_seed"] == 80 and saved["num_devices"] == 1
    assert saved["eval_episodes"] == 2
    assert saved["headline_metric"] == "episode_return" and saved["resumed_from_update"] is None
    assert os.path.getsize(os.path.join(run_dir, "learning_curve.png")) > 1000


def test_same_seed_same_numbers_and_seed_i_equals_a_single_run(tmp_path):
    together = train(tmp_path, num_seeds=3)
    assert_identical_runs(together["run_dir"], train(tmp_path, num_seeds=3)["run_dir"])
    alone = train(tmp_path, seed=3)
    np.testing.assert_array_equal(
        metric_table(together["run_dir"], 2), metric_table(alone["run_dir"], 0)
    )
    assert len(set(together["final_per_seed"])) == 3  # seeds differ


def test_sweep_configuration_equals_a_single_run(tmp_path):
    sweep = train(tmp_path, num_seeds=2, sweep=("rate=0.1,0.5", "limit=1,2"))
    # configuration 2 (rate 0.5, limit 1), seed index 1, is run 2 * 2 + 1
    alone = train(tmp_path, rate=0.5, limit=1, seed=2)
    run_dir = sweep["run_dir"]
    np.testing.assert_array_equal(metric_table(run_dir, 1, 2), metric_table(alone["run_dir"], 0))
    assert sweep["seeds"] == [1, 2] * 4
    ranking = sweep["sweep"]["ranking"]
    assert sweep["sweep"]["parameters"] == ["rate", "limit"]
    means = [r["final_mean"] for r in ranking]
    assert means == sorted(means, reverse=True)
    third = next(r for r in ranking if r["config"] == 2)
    assert third["hyperparams"] == {"rate": 0.5, "limit": 1}
    assert third["final_per_seed"] == sweep["final_per_seed"][4:6]
    rows = read_rows(run_dir)
    assert [(r["config"], r["seed"], r["rate"], r["limit"]) for r in rows[4:6]] == [
        ("2", "0", "0.5", "1"),
        ("2", "1", "0.5", "1"),
    ]


def test_every_sweep_configuration_is_validated_before_anything_is_written(tmp_path):
    with pytest.raises(ConfigError, match=r"--rate must be >= 0, got -1\.0"):
        train(tmp_path, sweep=("rate=0.5,-1",))
    assert not (tmp_path / "runs").exists()
    assert train(tmp_path, sweep=("rate=0.5,-1",), negative_rate=True)["sweep"]


# ---------------------------------------------------------------------------------------------
# Resume and checkpoints
# ---------------------------------------------------------------------------------------------


def interrupted_after_update_4(tmp_path, monkeypatch) -> tuple[str, str]:
    """An uninterrupted run and the same run stopped by Ctrl-C after update 4 (exit 130):
    their run directories."""
    uninterrupted = train(tmp_path, updates_per_chunk=2)["run_dir"]

    def interrupt_after_update_4(self, done, *_):
        if done == 4:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(driver._Progress, "update", interrupt_after_update_4)
        with pytest.raises(SystemExit) as exit_info:
            train(tmp_path, updates_per_chunk=2)
    assert exit_info.value.code == 130
    runs_dir = os.path.dirname(uninterrupted)
    (interrupted,) = [d for d in os.listdir(runs_dir) if d != os.path.basename(uninterrupted)]
    return uninterrupted, os.path.join(runs_dir, interrupted)


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, monkeypatch):
    uninterrupted, interrupted = interrupted_after_update_4(tmp_path, monkeypatch)
    assert checkpoint.latest_update(os.path.join(interrupted, "checkpoints")) == 4
    assert not os.path.exists(os.path.join(interrupted, "summary.json"))

    summary = train(tmp_path, resume=interrupted)
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


def test_track_logs_to_wandb_offline_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = Path(train(tmp_path, track=True)["run_dir"])
    assert list((run_dir / "wandb").glob("offline-run-*")), os.listdir(run_dir)


@pytest.mark.parametrize(
    ("num_updates", "expected"),
    # 10**12 updates (DQN with --total-timesteps 1e13): planning must not walk 10**11 lengths
    [(1, 1), (24, 1), (976, 61), (1220, 61), (1000, 40), (997, 40), (10**12, 4 * 10**10)],
)
def test_auto_chunk_length_divides_when_it_can(num_updates, expected):
    assert auto_updates_per_chunk(num_updates) == expected


# ---------------------------------------------------------------------------------------------
# The contract's checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["chunk", "build"])
def test_a_trainer_that_reads_a_swept_field_is_refused_naming_it(tmp_path, where):
    """A copy whose code reads config.rate instead of hp.rate would ignore --sweep rate=..."""
    make_train = make_stub(**{f"read_in_{where}": "rate"})
    with pytest.raises(TrainerContractError, match=r"config\.rate.*hp\.rate"):
        train(tmp_path, make_train, sweep=("rate=0.1,0.5",))
    assert not any((tmp_path / "runs").glob("*/metrics.csv"))  # before the first chunk ran


def test_fields_that_shape_the_program_stay_readable():
    trainer = build_trainer(make_stub(read_in_build="num_updates"), StubConfig(), Runtime())
    assert trainer.num_updates == 8


def test_the_config_is_never_mutated():
    def make_train(config, runtime):
        config.num_devices = 1

    with pytest.raises(TrainerContractError, match="never mutated"):
        build_trainer(make_train, StubConfig(), Runtime())


def test_hyperparams_take_the_declared_type_of_their_field():
    hp = hyperparams_of(StubHyperParams, StubConfig(rate=1, limit=2))
    assert hp.rate.dtype == np.float32 and hp.limit.dtype == np.int32


def test_hyperparams_must_be_named_after_config_fields():
    class Misnamed(NamedTuple):
        lr: jax.Array

    with pytest.raises(TrainerContractError, match=r"\['lr'\] are not Config fields"):
        hyperparams_of(Misnamed, StubConfig())


def test_a_metric_must_have_one_value_per_update():
    check_chunk_metrics({"loss": np.zeros((2, 5)), "record_moves": np.zeros((2, 9))}, 5)
    with pytest.raises(TrainerContractError, match=r"'loss' has shape \(\)"):
        check_chunk_metrics({"loss": np.zeros(2)}, 5)


def test_train_needs_no_driver_and_no_device_axis():
    train_fn = make_stub()(StubConfig()).train
    keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)])
    state, metrics = jax.jit(jax.vmap(train_fn))(keys)
    assert metrics["episode_return"].shape == (2, 8)
    np.testing.assert_allclose(metrics["episode_return"][:, -1], state["x"])


def test_train_refuses_a_trainer_built_for_several_devices():
    trainer = make_stub()(StubConfig(), Runtime(num_devices=2))
    with pytest.raises(TrainerContractError, match="one device"):
        trainer.train(jax.random.PRNGKey(0))


def test_a_torn_last_row_of_metrics_csv_is_dropped_on_resume(tmp_path, monkeypatch, capsys):
    """A SIGKILL or a full disk can cut the last row inside its first field, e.g. update 30's
    row to "3": the resume drops it with a note instead of keeping "3,,,," (3 is before the
    checkpoint) and failing in the report."""
    uninterrupted, interrupted = interrupted_after_update_4(tmp_path, monkeypatch)
    with open(os.path.join(interrupted, "metrics.csv"), "a") as f:
        f.write("3")
    summary = train(tmp_path, resume=str(interrupted))
    assert "dropped 1 incomplete row" in capsys.readouterr().err
    assert summary["final_per_seed"] == train(tmp_path)["final_per_seed"]
    np.testing.assert_array_equal(metric_table(uninterrupted, 0), metric_table(interrupted, 0))


# ---------------------------------------------------------------------------------------------
# Interruptions, resume edge cases and concurrent runs
# ---------------------------------------------------------------------------------------------


def test_resuming_a_finished_run_says_so_and_touches_nothing(tmp_path, capsys):
    run_dir = Path(train(tmp_path)["run_dir"])
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    summary = train(tmp_path, resume=str(run_dir))
    assert "already complete" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert summary == json.loads((run_dir / "summary.json").read_text())


def test_resume_refuses_another_trainers_run_directory(tmp_path):
    run_dir = Path(train(tmp_path)["run_dir"])
    (run_dir / "run.json").write_text(json.dumps({"algo": "dqn", "env_id": "CartPole-v1"}))
    with pytest.raises(ConfigError, match="is a dqn run, not a stub one"):
        train(tmp_path, resume=str(run_dir))


def test_a_run_directory_without_a_checkpoint_resumes_from_the_start(tmp_path, capsys):
    done = train(tmp_path)
    run_dir = Path(done["run_dir"])
    for path in (run_dir / "checkpoints", run_dir / "summary.json", run_dir / "metrics.csv"):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    again = train(tmp_path, resume=str(run_dir))
    assert "has no checkpoint yet: the run starts over" in capsys.readouterr().err
    assert again["final_per_seed"] == done["final_per_seed"]
    assert again["resumed_from_update"] == 0


def test_a_second_process_on_a_running_directory_is_refused(tmp_path):
    run_dir = Path(train(tmp_path, updates_per_chunk=2)["run_dir"])
    shutil.rmtree(run_dir / "checkpoints")
    with open(run_dir / ".lock", "w") as held:  # as the first process holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ConfigError, match="is in use by another training process"):
            train(tmp_path, resume=str(run_dir))


def test_launches_in_the_same_second_get_a_directory_each(tmp_path):
    config = StubConfig(runs_dir=str(tmp_path))
    trainer = make_stub()(config)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        dirs = list(pool.map(lambda _: driver._new_run_dir(config, trainer), range(16)))
    assert len(set(dirs)) == 16 and all(os.path.isfile(f"{d}/config.json") for d in dirs)


def test_ctrl_c_before_the_first_checkpoint_leaves_no_directory(tmp_path, monkeypatch, capsys):
    def interrupt(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(driver._ChunkRunner, "__call__", interrupt)  # e.g. while compiling
    with pytest.raises(SystemExit) as exit_info:
        train(tmp_path)
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "before the first checkpoint" in err and "--resume" not in err
    assert not any((tmp_path / "runs").iterdir())


def test_progress_is_one_plain_line_per_chunk_where_stdout_is_not_a_terminal(tmp_path, capsys):
    config = StubConfig(runs_dir=str(tmp_path), updates_per_chunk=4)  # progress on
    run_training(config, make_stub(), stub_validate)
    lines = [line for line in capsys.readouterr().out.splitlines() if ": update " in line]
    assert [line.split(",")[0] for line in lines] == ["stub: update 4/8", "stub: update 8/8"]
    assert "80 steps, episode_return 0.99" in lines[-1] and lines[-1].endswith("ETA 0 s")


# ---------------------------------------------------------------------------------------------
# The reductions every reported number goes through, against plain loops
# ---------------------------------------------------------------------------------------------


def test_final_values_average_the_last_tenth_of_updates_that_reported():
    # 2 configurations x 2 seeds, 20 updates; the metric is NaN where nothing was reported
    rng = np.random.default_rng(0)
    rows = [(u, c, s) for u in range(1, 21) for c in range(2) for s in range(2)]
    values = rng.normal(size=len(rows))
    values[[i for i, (u, c, s) in enumerate(rows) if (c, s) == (1, 1) and u > 3]] = np.nan
    columns = {
        "update": np.array([r[0] for r in rows], float),
        "config": np.array([r[1] for r in rows], float),
        "seed": np.array([r[2] for r in rows], float),
        "m": values,
    }
    finals = driver._final_values(columns, "m", num_seeds=2, num_runs=4, num_updates=20)
    for run, (c, s) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        mine = [v for v, (u, rc, rs) in zip(values, rows, strict=True) if (rc, rs) == (c, s)]
        if run < 3:  # updates 19 and 20: the last 10%
            assert finals[run] == pytest.approx(np.mean(mine[-2:]))
        else:  # reported only up to update 3: its last value
            assert finals[run] == pytest.approx(mine[2])


def test_sweep_ranking_orders_configurations_by_mean_final_value_nan_last():
    overrides = [{"rate": 0.1}, {"rate": 0.2}, {"rate": 0.3}]
    finals = [1.0, 3.0, np.nan, np.nan, 2.5, 2.5]  # 2 seeds each
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mean of no finite value
        ranking = driver._sweep_ranking(overrides, finals, [0.5] * 6)
    assert [r["config"] for r in ranking] == [2, 0, 1]
    assert ranking[0]["final_mean"] == 2.5 and ranking[0]["final_std"] == 0.0
    assert ranking[1]["final_std"] == 1.0 and ranking[1]["hyperparams"] == {"rate": 0.1}
    assert np.isnan(ranking[2]["final_mean"])
