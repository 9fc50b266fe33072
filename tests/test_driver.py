"""The driver and the trainer contract, specified with a stub trainer that compiles in a blink:
run directory, seeds and sweeps side by side, resume, checkpoints, wandb, the contract's checks
(swept values unreadable to compiled code, the config never mutated), the divergence guard,
files that cannot be written, and the re-evaluation of a finished run."""

import concurrent.futures
import csv
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import (
    assert_identical_runs,
    checkpoint_leaves,
    interrupt_after_update_4,
    metric_table,
    run_script,
)
from utils import checkpoint, driver, interrupts, logs, plotting
from utils.cli import RunConfig, parse_config
from utils.devices import device_mean
from utils.driver import auto_updates_per_chunk, run_training
from utils.errors import ConfigError, OutputError
from utils.trainer import (
    Runtime,
    Trainer,
    TrainerContractError,
    build_trainer,
    check_chunk_metrics,
    hyperparams_of,
    scan_updates,
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
    eval_episodes: int = 2  # "episodes" of the evaluation after training (0: none)
    nan_at: int = 0  # x turns NaN at this update, as a diverging run's parameters (0: never)
    loss_from: int = 1  # the loss is NaN before this update, as DQN's before learning starts
    ballast: int = 0  # floats of dead weight in the state, for a checkpoint of that size
    checkpoint_every: int = 1  # the tests name checkpoints; the automatic schedule's own test: 0


class StubHyperParams(NamedTuple):
    rate: jax.Array
    target: jax.Array
    limit: jax.Array


def stub_validate(config, runtime):
    if config.rate < 0 and not config.negative_rate:
        raise ConfigError(f"--rate must be >= 0, got {config.rate}")


def make_stub(
    read_in_chunk: str | None = None,
    read_in_build: str | None = None,
    evaluate_in_chunks: bool = False,
):
    """The stub's make_train; `read_in_*` names a config field that it wrongly reads inside its
    compiled chunk or while it is built. Its evaluation after training gives `eval_episodes`
    returns, all x; with `evaluate_in_chunks` it has none and evaluates as AlphaZero does, at
    the end of each chunk (eval_x)."""

    def make_train(config, runtime=None):
        if read_in_build:
            getattr(config, read_in_build)

        def train_chunk(state, num_updates, num_active=None):
            def update(carry, _):
                x, done = carry
                done = done + 1
                rate = getattr(config, read_in_chunk) if read_in_chunk else state["hp"].rate
                # the loss of the update's starting point, as a trainer's loss is computed
                # before its gradient step
                loss = jnp.where(
                    done >= config.loss_from, jnp.square(x - state["hp"].target), jnp.nan
                )
                x = x + rate * (state["hp"].target - x)
                x = jnp.where(done == config.nan_at, jnp.nan, x)
                return (x, done), {"episode_return": x, "loss": loss}

            (x, done), metrics = scan_updates(
                update, (state["x"], state["updates"]), num_updates, num_active
            )
            return {**state, "x": x, "updates": done}, metrics

        def evaluate_x(state):
            return device_mean(state["x"])

        def init(key, hp):
            state = {"x": jax.random.uniform(key), "hp": hp, "updates": jnp.int32(0)}
            if config.ballast:  # random, so that no compression makes it small
                state["ballast"] = jax.random.uniform(key, (config.ballast,))
            return state

        return Trainer(
            algo="stub",
            env_id=config.env,
            num_updates=config.num_updates,
            steps_per_update=10,
            hyperparams=hyperparams_of(StubHyperParams, config),
            init=init,
            train_chunk=train_chunk,
            evaluate=None
            if evaluate_in_chunks or not config.eval_episodes
            else lambda state, key: jnp.full(config.eval_episodes, state["x"]),
            runtime=runtime or Runtime(),
            guarded_metrics=("loss",),
            guarded_state=lambda state: state["x"],
            chunk_evaluation=(lambda state: {"eval_x": evaluate_x(state)})
            if evaluate_in_chunks
            else None,
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


def test_the_chunk_program_makes_the_hyperparameters_every_run_shares_constants(tmp_path):
    # A stub whose state holds other values than the runs' HyperParams: rate 1 and target + 1.
    # The chunk program takes the shared target from the runs' values (its constant, 1.0) and
    # the swept rate from the state (1.0), so that every run's x reaches 1.0 in one update.
    # Read from the state alone, x would reach 2.0; with the rate folded too, x would not
    # reach 1.0 in one update.
    stub = make_stub()

    def make_train(config, runtime=None):
        trainer = stub(config, runtime)

        def init(key, hp):
            state = trainer.init(key, hp)
            return {**state, "hp": hp._replace(rate=jnp.ones_like(hp.rate), target=hp.target + 1)}

        return dataclasses.replace(trainer, init=init)

    summary = train(tmp_path, make_train, num_seeds=2, sweep=("rate=0.1,0.5",), eval_episodes=0)
    rows = read_rows(summary["run_dir"])
    assert [float(r["episode_return"]) for r in rows] == [1.0] * len(rows)


def test_a_headline_metric_never_reported_ends_the_run_without_numpy_warnings(tmp_path):
    """No run reported its headline metric (no episode ended in a short run, here NaN from the
    first update): final_mean and final_std are NaN, in the summary and in the sweep's ranking,
    and no NumPy warning about an empty mean reaches the user's terminal."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        summary = train(
            tmp_path, nan_at=1, allow_nonfinite=True, num_seeds=2, sweep=("rate=0.5,0.25",)
        )
    assert np.isnan(summary["final_per_seed"]).all()
    assert np.isnan(summary["final_mean"]) and np.isnan(summary["final_std"])
    for entry in summary["sweep"]["ranking"]:
        assert np.isnan(entry["final_mean"]) and np.isnan(entry["final_std"])


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


def test_stop_when_ends_training_after_a_chunk_and_resume_trains_on(tmp_path):
    """`run_training`'s stop_when sees each chunk's update and metrics; True ends the run
    there with a full report, and --resume continues to the same numbers as a run that was
    never stopped."""
    seen = []

    def past_half(update, metrics):
        seen.append((update, metrics["episode_return"].shape))
        return bool((metrics["episode_return"][:, -1] > 0.5).all())

    uninterrupted = train(tmp_path / "whole", num_updates=12, updates_per_chunk=2, target=1.0)
    config = StubConfig(
        runs_dir=str(tmp_path / "runs"), progress=False, num_updates=12, updates_per_chunk=2
    )
    stopped = run_training(config, make_stub(), stub_validate, stop_when=past_half)
    # x starts in [0, 1) and halves its distance to 1 each update: above 0.5 by update 2
    assert seen == [(2, (1, 2))]
    assert stopped["stopped_at_update"] == 2 and len(stopped["chunk_ends"]) == 1
    assert len(read_rows(stopped["run_dir"])) == 2
    assert stopped["eval_return_per_seed"] is not None  # reported as at its last update
    assert uninterrupted["stopped_at_update"] is None

    resumed = train(tmp_path, resume=stopped["run_dir"], num_updates=12, updates_per_chunk=2)
    assert resumed["resumed_from_update"] == 2 and resumed["stopped_at_update"] is None
    np.testing.assert_array_equal(
        metric_table(uninterrupted["run_dir"], 0), metric_table(stopped["run_dir"], 0)
    )


def recorded_launches(monkeypatch) -> list[tuple]:
    """The driver's chunk launches, collections, metrics.csv appends and checkpoint saves, in
    their order: ("launch", the update it trains from), ("collect",), ("csv", its first
    update), ("save", its update)."""
    events = []
    real_launch, real_collect = driver._ChunkRunner.launch, driver._ChunkRunner.collect
    real_append, real_save = driver.MetricsCsv.append, checkpoint.save

    def launch(self, state, num_updates):
        events.append(("launch", int(np.asarray(state["updates"]).ravel()[0])))
        return real_launch(self, state, num_updates)

    def collect(self, launched):
        events.append(("collect",))
        return real_collect(self, launched)

    def append(self, first_update, *args):
        events.append(("csv", first_update))
        return real_append(self, first_update, *args)

    def save(directory, update, *args, **kwargs):
        events.append(("save", update))
        return real_save(directory, update, *args, **kwargs)

    monkeypatch.setattr(driver._ChunkRunner, "launch", launch)
    monkeypatch.setattr(driver._ChunkRunner, "collect", collect)
    monkeypatch.setattr(driver.MetricsCsv, "append", append)
    monkeypatch.setattr(checkpoint, "save", save)
    return events


def test_the_next_chunk_trains_while_the_host_writes_the_last_one(tmp_path, monkeypatch):
    """Each chunk but the last launches the next before its metrics.csv rows and its
    checkpoint are written; one after which training stops (`stop_when`, divergence)
    launches none."""
    events = recorded_launches(monkeypatch)
    train(tmp_path / "whole", num_updates=6, updates_per_chunk=2, checkpoint_every=1)
    assert events == [
        ("launch", 0), ("collect",),
        ("launch", 2), ("csv", 1), ("save", 2), ("collect",),
        ("launch", 4), ("csv", 3), ("save", 4), ("collect",),
        ("csv", 5), ("save", 6),
    ]  # fmt: skip
    events.clear()
    config = StubConfig(
        runs_dir=str(tmp_path / "runs"),
        progress=False,
        num_updates=6,
        updates_per_chunk=2,
        checkpoint_every=1,
    )
    run_training(config, make_stub(), stub_validate, stop_when=lambda update, _: update == 4)
    first_two_chunks = [
        ("launch", 0), ("collect",),
        ("launch", 2), ("csv", 1), ("save", 2), ("collect",),
        ("csv", 3),
    ]  # fmt: skip
    assert events == [*first_two_chunks, ("save", 4)]
    events.clear()
    with pytest.raises(SystemExit):  # the state before the diverged chunk is saved already
        train(tmp_path / "diverged", num_updates=6, updates_per_chunk=2, nan_at=4)
    assert events == first_two_chunks


def recorded_saves(monkeypatch, seconds: float = 0.0) -> list[int]:
    """The updates whose checkpoints the driver saves; each save takes `seconds` longer, as a
    large state's does."""
    real, saved = checkpoint.save, []

    def save(directory, update, *args, **kwargs):
        saved.append(update)
        time.sleep(seconds)
        return real(directory, update, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save", save)
    return saved


def test_checkpoint_every_n_chunks_and_where_the_run_ends(tmp_path, monkeypatch):
    saved = recorded_saves(monkeypatch)
    train(tmp_path, num_updates=10, updates_per_chunk=2, checkpoint_every=2, keep_checkpoints=0)
    assert saved == [4, 8, 10]


def test_automatic_checkpoints_keep_their_writing_to_a_share_of_the_training(tmp_path, monkeypatch):
    """Each save takes 0.6 s longer and each chunk is made to report 5 s more of training: a
    save is due once the training since the last one is at least 0.6 / 5% = 12 s, so every
    third chunk, after the first and before the last, which are always saved. (Margins: a
    real save may take up to 0.15 s, two real chunks up to 1 s.)"""
    saved = recorded_saves(monkeypatch, seconds=0.6)
    real_collect = driver._ChunkRunner.collect

    def five_seconds_more_training(self, launched):
        out = real_collect(self, launched)
        self.clock.train_seconds += 5.0
        return out

    monkeypatch.setattr(driver._ChunkRunner, "collect", five_seconds_more_training)
    summary = train(tmp_path, num_updates=16, updates_per_chunk=2, checkpoint_every=0)
    assert driver.CHECKPOINT_SHARE == 0.05
    assert saved == [2, 8, 14, 16]
    assert [end["update"] for end in summary["chunk_ends"]] == list(range(2, 17, 2))


def test_a_stop_saves_the_state_it_stops_at_between_automatic_checkpoints(tmp_path, monkeypatch):
    """A stop asked for during the third chunk, whose checkpoint is not due (saves are slow):
    the driver saves it, exits 130, and the run resumes from it to the uninterrupted numbers."""
    uninterrupted = train(tmp_path / "whole", updates_per_chunk=2)["run_dir"]
    saved = recorded_saves(monkeypatch, seconds=0.25)
    real_collect, asked = driver._ChunkRunner.collect, []

    def stop_asked_during_the_third_chunk(self, launched):
        out = real_collect(self, launched)
        asked.append(len(asked) == 2 or bool(asked and asked[-1]))
        return out

    def check():
        if interrupts.stop_requested():
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(driver._ChunkRunner, "collect", stop_asked_during_the_third_chunk)
        patch.setattr(interrupts, "stop_requested", lambda: bool(asked and asked[-1]))
        patch.setattr(interrupts, "check", check)
        with pytest.raises(SystemExit) as exit_info:
            train(tmp_path, updates_per_chunk=2, checkpoint_every=0)
    assert exit_info.value.code == 130
    assert saved == [2, 6]
    run_dir = only_run_dir(tmp_path / "runs")
    assert train(tmp_path, resume=str(run_dir))["resumed_from_update"] == 6
    np.testing.assert_array_equal(metric_table(uninterrupted, 0), metric_table(run_dir, 0))


def test_the_first_chunk_compiles_beside_the_initial_state(tmp_path, monkeypatch):
    """The chunks' program is traced and compiled in a background thread, from the state's
    shapes, while the main thread compiles and computes the initial state; a shorter last
    chunk runs the same program. Once the first chunk has trained, the evaluation after
    training compiles in a background thread too. A resumed run does the same from its own
    first chunk."""
    traced = []

    def thread() -> str:
        return threading.current_thread().name.split("_")[0]

    def make_train(config, runtime=None):
        trainer = make_stub()(config, runtime)

        def train_chunk(state, num_updates, num_active=None):
            traced.append((thread(), num_updates))
            return trainer.train_chunk(state, num_updates, num_active)

        def evaluate(state, key):
            traced.append((thread(), "evaluate"))
            return trainer.evaluate(state, key)

        return dataclasses.replace(trainer, train_chunk=train_chunk, evaluate=evaluate)

    def in_order(first_chunk, *others):  # the others in any order
        assert traced[0] == ("compile", first_chunk)
        assert sorted(traced[1:], key=str) == sorted([("compile", o) for o in others], key=str)

    train(tmp_path / "fresh", make_train, num_updates=10, updates_per_chunk=4)
    in_order(4, "evaluate")
    traced.clear()
    train(tmp_path / "even", make_train, num_updates=8, updates_per_chunk=4)
    in_order(4, "evaluate")
    _, interrupted = interrupted_after_update_4(tmp_path, monkeypatch)
    for running in threading.enumerate():  # the stopped run's evaluation may still compile
        if running.name.startswith("compile"):
            running.join()
    traced.clear()
    summary = train(tmp_path, make_train, resume=interrupted, updates_per_chunk=3)
    assert summary["resumed_from_update"] == 4
    in_order(3, "evaluate")


def test_the_first_chunk_trains_while_its_evaluation_compiles(tmp_path, monkeypatch):
    """A chunk evaluation's program (AlphaZero's) is traced once the chunk's is lowered, and
    the first chunk is launched as soon as its own program has compiled: here the evaluation's
    tracing waits for the first chunk's launch, which it would wait for in vain if the launch
    waited for every program."""
    launched, waits = threading.Event(), []
    real_program = driver._ChunkRunner._program

    def program(self, index, args):
        compiled = real_program(self, index, args)
        if index == 1:
            return compiled

        def chunk(*chunk_args):
            out = compiled(*chunk_args)
            launched.set()
            return out

        return chunk

    def make_train(config, runtime=None):
        trainer = make_stub(evaluate_in_chunks=True)(config, runtime)

        def chunk_evaluation(state):
            waits.append(launched.wait(timeout=20))
            return trainer.chunk_evaluation(state)

        return dataclasses.replace(trainer, chunk_evaluation=chunk_evaluation)

    monkeypatch.setattr(driver._ChunkRunner, "_program", program)
    summary = train(tmp_path, make_train, num_updates=4, updates_per_chunk=2)
    assert waits == [True]
    rows = read_rows(summary["run_dir"])
    assert [r["eval_x"] != "nan" for r in rows] == [False, True, False, True]


def test_checkpoint_reads_back_every_dtype_and_the_orbax_format_of_earlier_versions(tmp_path):
    state = {
        "w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
        "h": jnp.arange(4, dtype=jnp.bfloat16) / 3,
        "key": np.asarray(jax.random.PRNGKey(7)),
        "done": np.array([True, False]),
        "count": np.int64(12),
    }
    meta = {"update": 5, "train_seconds": 1.25}
    checkpoint.save(str(tmp_path / "npz"), 5, state, meta)
    restored, read_meta = checkpoint.restore(str(tmp_path / "npz"), state)
    assert read_meta == meta
    for name, leaf in state.items():
        assert restored[name].dtype == np.asarray(leaf).dtype, name
        np.testing.assert_array_equal(restored[name], np.asarray(leaf))

    # A run directory of an earlier version, written with orbax, resumes after an upgrade.
    import orbax.checkpoint as ocp

    leaves = jax.tree.leaves(jax.device_get(state))
    tree = {
        "leaves": {f"{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)},
        "meta": {k: np.asarray(v) for k, v in meta.items()},
    }
    ocp.PyTreeCheckpointer().save(str(tmp_path / "orbax" / "update_00000005"), tree)
    restored, read_meta = checkpoint.restore(str(tmp_path / "orbax"), state)
    assert read_meta == meta
    for name, leaf in state.items():
        np.testing.assert_array_equal(restored[name], np.asarray(leaf))


def test_checkpoint_of_a_state_in_other_shapes_is_refused_and_kept(tmp_path):
    """A checkpoint whose leaves have other shapes than the config's state (another seed
    count, or a version that stored its buffer env-shaped) is a ConfigError, left on disk."""
    checkpoint.save(str(tmp_path), 1, {"obs": np.zeros((4, 10, 10, 4), np.uint8)}, {"update": 1})
    with pytest.raises(ConfigError, match="does not match this config's state"):
        checkpoint.restore(str(tmp_path), {"obs": np.zeros((4, 400), np.uint8)})
    restored, _ = checkpoint.restore(str(tmp_path), {"obs": np.ones((4, 10, 10, 4), np.uint8)})
    np.testing.assert_array_equal(restored["obs"], 0)


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    state = {"w": np.arange(3.0)}
    checkpoint.save(str(tmp_path), 1, state, {"update": 1})

    real_savez = np.savez

    def crash(file, **arrays):
        real_savez(file, **{k: v for k, v in list(arrays.items())[:1]})  # half written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.np, "savez", crash)
    with pytest.raises(OSError, match=r"No space left on device.*update_00000002"):
        checkpoint.save(str(tmp_path), 2, {"w": np.zeros(3)}, {"update": 2})
    assert os.listdir(tmp_path) == ["update_00000001"]  # nothing half-written is left
    assert checkpoint.latest_update(str(tmp_path)) == 1
    restored, meta = checkpoint.restore(str(tmp_path), state)
    np.testing.assert_array_equal(restored["w"], np.arange(3.0))
    assert meta == {"update": 1}


def test_track_logs_to_wandb_offline_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    run_dir = Path(train(tmp_path, track=True)["run_dir"])
    assert list((run_dir / "wandb").glob("offline-run-*")), os.listdir(run_dir)


@pytest.mark.parametrize("num_updates", [7, 2500])  # a point per update; per 3 updates
def test_wandb_points_are_means_of_consecutive_updates_against_a_loop(num_updates, monkeypatch):
    """A chunk of 7 updates of 2 runs, its metrics NaN where nothing was reported: every point
    is the mean of the finite values of its updates (both runs, and each run's headline),
    logged at the env steps of its last update."""
    rng = np.random.default_rng(0)
    metrics = {"episode_return": rng.normal(size=(2, 7)), "loss": rng.normal(size=(2, 7))}
    metrics["episode_return"][rng.random((2, 7)) < 0.4] = np.nan
    metrics["episode_return"][:, 5] = np.nan  # an update where no episode ended
    metrics["loss"][0, 3] = np.inf

    logged = []

    class Run:
        def log(self, row, step):
            logged.append((step, row))

    import wandb

    monkeypatch.setattr(wandb, "init", lambda **_: Run())
    sink = logs.WandbSink(RunConfig(), "", "run", "episode_return", ["s0", "s1"], num_updates)
    sink.log(11, 10, metrics)  # updates 11-17, 10 env steps each
    expected = []
    for start in range(0, 7, sink.stride):
        updates = range(start, min(start + sink.stride, 7))
        row = {}
        for name in ("episode_return", "loss"):
            finite = [metrics[name][r, k] for r in (0, 1) for k in updates]
            finite = [v for v in finite if np.isfinite(v)]
            if finite:
                row[f"{name}/mean"] = np.mean(finite)
        for run, label in enumerate(("s0", "s1")):
            finite = [metrics["episode_return"][run, k] for k in updates]
            finite = [v for v in finite if np.isfinite(v)]
            if finite:
                row[f"episode_return/{label}"] = np.mean(finite)
        expected.append(((11 + updates[-1]) * 10, row))
    assert sink.stride == (1 if num_updates == 7 else 3)
    assert [step for step, _ in logged] == [step for step, _ in expected]
    for (_, row), (_, want) in zip(logged, expected, strict=True):
        assert row.keys() == want.keys()
        for key in row:
            assert row[key] == pytest.approx(want[key], rel=1e-12)


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


def test_a_train_chunk_without_num_active_is_refused():
    def make_train(config, runtime):
        trainer = make_stub()(config, runtime)
        return dataclasses.replace(trainer, train_chunk=lambda state, num_updates: None)

    with pytest.raises(TrainerContractError, match=r"\(state, num_updates, num_active=None\)"):
        build_trainer(make_train, StubConfig(), Runtime())
    build_trainer(make_stub(), StubConfig(), Runtime())  # the stub's takes it


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
    with pytest.raises(TrainerContractError, match=r"guarded_metrics \['los'\] are not metrics"):
        check_chunk_metrics({"loss": np.zeros((2, 5))}, 5, guarded=("los",))


def test_scan_updates_runs_only_the_active_updates_against_a_loop():
    traces = []

    def update(state, _):
        traces.append(1)
        total, count = state
        total = total * 0.5 + count
        return (total, count + 1), {"total": total, "count": count}

    start = (jnp.float32(3.0), jnp.int32(1))
    expected_state, totals, counts = start, [], []
    for _ in range(3):  # the reference: three updates in a plain loop
        (total, count), _ = update(expected_state, None)
        totals.append(float(total))
        counts.append(int(expected_state[1]))
        expected_state = (total, count)

    for num_active in (None, jnp.int32(3)):  # the scan, and 3 of a program of 5
        length = 3 if num_active is None else 5
        traces.clear()
        state, outs = jax.jit(lambda s, n, length=length: scan_updates(update, s, length, n))(
            start, num_active
        )
        np.testing.assert_array_equal(state, expected_state)
        np.testing.assert_array_equal(outs["total"][:3], totals)
        np.testing.assert_array_equal(outs["count"][:3], counts)
        if num_active is not None:  # the updates that did not run: NaN, or zero for integers
            assert np.isnan(outs["total"][3:]).all() and (outs["count"][3:] == 0).all()
        assert len(traces) == 1  # tracing is much of a big program's compile time


def test_scan_updates_gives_each_output_back_as_a_plain_scan_does():
    """Scalars leave the scan stacked by dtype: every output, scalar or not, of every dtype and
    at any depth of the structure, comes back with its own values, shape and dtype, in both
    the scan and the masked loop (where the updates that did not run stay NaN or zero)."""

    def update(step, _):
        x = step.astype(jnp.float32)
        out = {
            "a": x,
            "b": (step * 2, jnp.bfloat16(x / 3)),
            "c": {"vector": jnp.stack([x, -x, x * x]), "flag": step % 2 == 0},
            "d": x + 0.5,
            "e": -step,
        }
        return step + 1, out

    expected_step, expected = jax.lax.scan(update, jnp.int32(0), None, 4)
    for num_active in (None, jnp.int32(4)):
        length = 4 if num_active is None else 6
        step, got = jax.jit(lambda s, n, length=length: scan_updates(update, s, length, n))(
            jnp.int32(0), num_active
        )
        assert step == expected_step
        assert jax.tree.structure(got) == jax.tree.structure(expected)
        for want, leaf in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
            assert leaf.dtype == want.dtype and leaf.shape[1:] == want.shape[1:]
            np.testing.assert_array_equal(leaf[:4], want)
            if num_active is not None and jnp.issubdtype(leaf.dtype, jnp.inexact):
                assert np.isnan(np.asarray(leaf[4:], np.float32)).all()
            elif num_active is not None:
                assert not np.asarray(leaf[4:]).any()


def test_a_shorter_last_chunk_runs_the_same_program_to_the_same_numbers(tmp_path):
    """8 updates in chunks of 3, 3 and 2 train exactly as in chunks of 4, with one program; a
    trainer that evaluates in its chunks reports the last one at the run's last update."""
    even = train(tmp_path / "even", num_seeds=2, updates_per_chunk=4)
    uneven = train(tmp_path / "uneven", num_seeds=2, updates_per_chunk=3)
    assert [end["update"] for end in uneven["chunk_ends"]] == [3, 6, 8]
    assert uneven["final_per_seed"] == even["final_per_seed"]
    for seed in range(2):
        np.testing.assert_array_equal(
            metric_table(uneven["run_dir"], seed), metric_table(even["run_dir"], seed)
        )
    evaluated = train(
        tmp_path / "evaluated", make_stub(evaluate_in_chunks=True), updates_per_chunk=3
    )
    rows = read_rows(evaluated["run_dir"])
    assert [row["update"] for row in rows if row["eval_x"] != "nan"] == ["3", "6", "8"]
    assert float(rows[-1]["eval_x"]) == pytest.approx(float(rows[-1]["episode_return"]))


@pytest.mark.parametrize("evaluate_in_chunks", [False, True])
def test_train_needs_no_driver_and_no_device_axis(evaluate_in_chunks):
    """The whole run in one program; a chunk evaluation, as the driver would run it after the
    run's one chunk, reports at its last update only."""
    train_fn = make_stub(evaluate_in_chunks=evaluate_in_chunks)(StubConfig()).train
    keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)])
    state, metrics = jax.jit(jax.vmap(train_fn))(keys)
    assert metrics["episode_return"].shape == (2, 8)
    np.testing.assert_allclose(metrics["episode_return"][:, -1], state["x"])
    assert ("eval_x" in metrics) == evaluate_in_chunks
    if evaluate_in_chunks:
        assert np.isnan(metrics["eval_x"][:, :-1]).all()
        np.testing.assert_allclose(metrics["eval_x"][:, -1], state["x"])


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

    monkeypatch.setattr(driver._ChunkRunner, "launch", interrupt)  # e.g. while compiling
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


def test_the_summary_times_the_end_of_every_chunk(tmp_path):
    summary = train(tmp_path, updates_per_chunk=3)  # 8 updates: chunks of 3, 3 and 2
    ends = summary["chunk_ends"]
    assert [end["update"] for end in ends] == [3, 6, 8]
    walls = [end["wall_seconds"] for end in ends]
    assert walls == sorted(walls) and walls[-1] <= summary["wall_seconds"]
    for end in ends:  # the shorter last chunk ran the others' program
        assert 0 < end["compile_seconds"] <= end["wall_seconds"]
    assert ends[0]["compile_seconds"] == ends[1]["compile_seconds"] == ends[2]["compile_seconds"]


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


def test_last_reported_is_each_runs_last_finite_value_against_a_loop():
    rng = np.random.default_rng(1)
    rows = [(u, c, s) for u in range(1, 31) for c in range(2) for s in range(3)]
    columns = {
        "update": np.array([r[0] for r in rows], float),
        "config": np.array([r[1] for r in rows], float),
        "seed": np.array([r[2] for r in rows], float),
        "a": rng.normal(size=len(rows)),
        "b": rng.normal(size=len(rows)),
    }
    columns["a"][rng.random(len(rows)) < 0.7] = np.nan
    columns["b"][[i for i, (_, c, s) in enumerate(rows) if (c, s) == (1, 2)]] = np.nan  # never
    last = driver._last_reported(columns, ["a", "b"], num_seeds=3, num_runs=6)
    for run in range(6):
        c, s = divmod(run, 3)
        for name in ("a", "b"):
            mine = [v for v, r in zip(columns[name], rows, strict=True) if r[1:] == (c, s)]
            finite = [v for v in mine if np.isfinite(v)]
            if finite:
                assert last[run][name] == finite[-1]
            else:
                assert np.isnan(last[run][name]) and (run, name) == (5, "b")


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


def test_metrics_csv_reads_back_as_written(tmp_path):
    """Every value of a chunk's rows, NaN included, and a file with no rows yet."""
    path = str(tmp_path / "metrics.csv")
    sink = logs.MetricsCsv(path, {"seed": [0, 1]}, ["loss", "episodes"])
    assert logs.read_metrics_csv(path) == {}
    rng = np.random.default_rng(0)
    metrics = {"loss": rng.normal(size=(2, 3)).astype(np.float32), "episodes": np.ones((2, 3))}
    metrics["loss"][1, 2] = np.nan
    sink.append(4, 10, metrics)
    columns = logs.read_metrics_csv(path)
    np.testing.assert_array_equal(columns["update"], [4, 4, 5, 5, 6, 6])
    np.testing.assert_array_equal(columns["env_steps"], [40, 40, 50, 50, 60, 60])
    np.testing.assert_array_equal(columns["seed"], [0, 1] * 3)
    np.testing.assert_array_equal(columns["loss"], metrics["loss"].T.ravel())
    np.testing.assert_array_equal(columns["episodes"], np.ones(6))


def test_learning_curve_band_is_the_mean_min_and_max_of_each_step_against_a_loop():
    rng = np.random.default_rng(0)
    env_steps = rng.permutation(np.repeat(np.arange(1, 41) * 10.0, 5))  # 5 rows per step
    values = rng.normal(size=env_steps.size)
    values[rng.random(values.size) < 0.4] = np.nan
    values[env_steps == 30] = np.nan  # a step where nothing was reported: no point

    class Axes:
        def plot(self, x, y, label):
            self.line = (np.asarray(x), np.asarray(y))
            return (self,)

        def get_color(self):
            return "C0"

        def fill_between(self, x, low, high, **_):
            self.band = (np.asarray(low), np.asarray(high))

    axes = Axes()
    plotting._plot_band(axes, env_steps, values, "mean")
    expected = {}
    for step, value in zip(env_steps, values, strict=True):
        if np.isfinite(value):
            expected.setdefault(step, []).append(value)
    steps = sorted(expected)
    np.testing.assert_array_equal(axes.line[0], steps)
    np.testing.assert_allclose(axes.line[1], [np.mean(expected[s]) for s in steps], rtol=1e-12)
    np.testing.assert_array_equal(axes.band[0], [min(expected[s]) for s in steps])
    np.testing.assert_array_equal(axes.band[1], [max(expected[s]) for s in steps])


# ---------------------------------------------------------------------------------------------
# The divergence guard
# ---------------------------------------------------------------------------------------------


def strict_json(path):
    """A JSON file as strict readers (jq, JavaScript) read it: NaN or Infinity fails."""

    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which strict JSON readers reject")

    return json.loads(Path(path).read_text(), parse_constant=refuse)


def only_run_dir(runs_dir: Path) -> Path:
    (run_dir,) = runs_dir.iterdir()
    return run_dir


@pytest.mark.parametrize(
    ("nan_at", "metric", "described"),
    [
        # x turns NaN at update 5; the loss of update 6, computed from x before its step, first
        (5, "loss", "loss is nan at update 6"),
        # x turns NaN at the chunk's last update, whose loss is still finite
        (6, "parameters", "the parameters are not finite after update 6"),
    ],
)
@pytest.mark.parametrize("checkpoint_every", [1, 0])
def test_a_diverged_run_stops_after_its_chunk_and_keeps_the_last_finite_checkpoint(
    tmp_path, monkeypatch, capsys, nan_at, metric, described, checkpoint_every
):
    """With a checkpoint after every chunk, and with slow automatic ones that skip update 4's
    checkpoint until the divergence after it asks for it."""
    saved = recorded_saves(monkeypatch, seconds=0.25 * (not checkpoint_every))
    with pytest.raises(SystemExit) as exit_info:
        train(tmp_path, updates_per_chunk=2, nan_at=nan_at, checkpoint_every=checkpoint_every)
    assert saved == [2, 4]
    assert exit_info.value.code == driver.DIVERGED_EXIT_CODE == 3
    run_dir = only_run_dir(tmp_path / "runs")
    assert capsys.readouterr().err.strip().splitlines() == [
        f"diverged: {described}; kept the checkpoint of update 4 -> {run_dir}"
    ]
    assert os.listdir(run_dir / "checkpoints") == ["update_00000004"]
    rows = read_rows(run_dir)  # the diverged chunk's rows show the NaN
    assert [int(r["update"]) for r in rows] == list(range(1, 7))
    assert float(rows[-1]["episode_return"]) != float(rows[-1]["episode_return"])
    summary = strict_json(run_dir / "summary.json")
    assert summary["diverged"] == {"metric": metric, "update": 6, "seed": 1}
    assert summary["stopped_at_update"] is None  # diverged, not stopped by stop_when
    assert summary["eval_episodes"] == 0  # a diverged state is not evaluated

    # the run resumes from its last finite checkpoint; --allow-nonfinite trains through
    resumed = train(tmp_path, resume=str(run_dir), allow_nonfinite=True)
    assert resumed["resumed_from_update"] == 4 and resumed["diverged"] is None
    assert checkpoint.latest_update(str(run_dir / "checkpoints")) == 8


def test_allow_nonfinite_trains_to_the_end(tmp_path):
    summary = train(tmp_path, updates_per_chunk=2, nan_at=5, allow_nonfinite=True)
    assert summary["diverged"] is None
    assert checkpoint.latest_update(os.path.join(summary["run_dir"], "checkpoints")) == 8
    assert [r["loss"] for r in read_rows(summary["run_dir"])][5:] == ["nan"] * 3


def test_the_state_check_finds_every_non_finite_value_small_or_large_leaf():
    """`_state_finite` against a plain loop over the leaves: each of NaN, inf and -inf, in a
    small leaf (checked in one vector per dtype) or a large one (checked where it lies), of
    float32 or bfloat16; integer leaves are not checked. Vmapped over runs, as the chunk's
    program runs it."""
    rng = np.random.default_rng(0)
    large = driver.CONCATENATED_CHECK_SIZE + 1
    shapes = {"w": (3, 4), "b": (4,), "big": (large,), "half": (5,), "big_half": (large,)}

    def make_state(poison):
        state = {
            name: rng.normal(size=(2, *shape)).astype(
                jnp.bfloat16 if "half" in name else np.float32
            )
            for name, shape in shapes.items()
        }
        state["count"] = np.full((2, 3), 7, np.int32)
        for run, name, value in poison:
            flat = state[name][run].reshape(-1)
            flat[rng.integers(flat.size)] = value
        return state

    def reference(state, run):
        return all(
            np.isfinite(np.asarray(x[run], np.float32)).all()
            for x in state.values()
            if np.issubdtype(x.dtype, np.inexact) or x.dtype == jnp.bfloat16
        )

    check = jax.jit(jax.vmap(driver._state_finite))
    cases = [[]] + [
        [(run, name, value)]
        for name in shapes
        for value in (np.nan, np.inf, -np.inf)
        for run in (0, 1)
    ]
    for poison in cases:
        state = make_state(poison)
        expected = [reference(state, run) for run in (0, 1)]
        assert expected.count(False) == len(poison)  # the reference sees the poisoned run
        assert check(state).tolist() == expected, poison
    assert bool(jax.jit(driver._state_finite)({"count": np.int32(1)}))


def test_a_loss_not_reported_yet_is_not_divergence(tmp_path):
    """DQN's loss is NaN until learning starts: a chunk that is NaN from its start, with finite
    parameters, is a run that has nothing to report yet."""
    summary = train(tmp_path, updates_per_chunk=2, loss_from=4)
    assert summary["diverged"] is None
    assert [r["loss"] == "nan" for r in read_rows(summary["run_dir"])][:4] == [True] * 3 + [False]


# ---------------------------------------------------------------------------------------------
# Files that cannot be written: one sentence, exit code 1, the last checkpoint kept
# ---------------------------------------------------------------------------------------------


def disk_full(*_, **__):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write or flush: no file name


def failing_open(name: str, on_call: int = 1):
    """`open` for utils/logs.py whose `on_call`-th opening of a file called `name` fails as a
    full disk does."""
    calls = []

    def fake_open(path, *args, **kwargs):
        if os.path.basename(path) == name:
            calls.append(path)
            if len(calls) == on_call:
                disk_full()
        return open(path, *args, **kwargs)

    return fake_open


def checkpoint_disk_full_on_call(on_call: int):
    """The checkpoint's archive writer, whose `on_call`-th call fails as a full disk does."""
    real, calls = np.savez, []

    def savez(*args, **kwargs):
        calls.append(None)
        if len(calls) == on_call:
            disk_full()
        return real(*args, **kwargs)

    return savez


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        ("metrics.csv", 4),  # the third chunk's rows
        ("checkpoints/update_00000006", 4),
        ("summary.json", 8),
        ("learning_curve.png", 8),
    ],
)
def test_a_failed_write_is_one_sentence_exit_1_and_the_run_resumes(
    tmp_path, monkeypatch, capsys, path, kept
):
    with monkeypatch.context() as patch:
        if path == "metrics.csv":
            patch.setattr(logs, "open", failing_open("metrics.csv", 3), raising=False)
        elif path == "summary.json":
            patch.setattr(logs, "open", failing_open("summary.json.tmp"), raising=False)
        elif path == "learning_curve.png":
            patch.setattr(driver, "plot_learning_curve", disk_full)
        else:
            patch.setattr(checkpoint.np, "savez", checkpoint_disk_full_on_call(3))
        with pytest.raises(OutputError) as error:  # the command line: one line, exit 1
            train(tmp_path, updates_per_chunk=2)
    run_dir = only_run_dir(tmp_path / "runs")
    assert str(error.value).splitlines() == [
        f"could not write {run_dir / path}: No space left on device; the checkpoint "
        f"of update {kept} is intact: --resume {run_dir} continues from it"
    ]
    assert checkpoint.latest_update(str(run_dir / "checkpoints")) == kept
    resumed = train(tmp_path, resume=str(run_dir))
    assert resumed["resumed_from_update"] == kept
    uninterrupted = train(tmp_path / "uninterrupted", updates_per_chunk=2)["run_dir"]
    np.testing.assert_array_equal(metric_table(run_dir, 0), metric_table(uninterrupted, 0))


# A stub run whose files may not grow past 64 KiB (setrlimit, as a full disk does to a
# checkpoint of 200 KB, but unprivileged): its first checkpoint fails part way.
CHECKPOINT_TOO_LARGE = """
import resource, signal, sys
from tests.test_driver import StubConfig, make_stub, stub_validate
from utils.cli import exit_on_config_error
from utils.driver import run_training

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (2**16, 2**16))
with exit_on_config_error():
    config = StubConfig(
        runs_dir=sys.argv[1], progress=False, updates_per_chunk=4, ballast=50_000,
        compile_cache=False,  # the cache's files would hit the limit too
    )
    run_training(config, make_stub(), stub_validate)
"""


def test_a_checkpoint_that_cannot_be_written_is_one_sentence(tmp_path):
    """A file that hits the size limit mid-write: one line naming the checkpoint, no
    traceback, and no half-written directory left behind."""
    result = run_script("-c", CHECKPOINT_TOO_LARGE, str(tmp_path / "runs"))
    assert result.returncode == 1, result.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    assert result.stderr.strip().splitlines() == [
        f"error: could not write {run_dir}/checkpoints/update_00000004: File too large; "
        f"{run_dir} has no checkpoint yet: --resume {run_dir} starts it over"
    ]
    assert not os.listdir(run_dir / "checkpoints")  # nothing half-written is left


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_run_directory_made_read_only_mid_run(tmp_path, monkeypatch, capsys):
    def read_only_after_update_4(self, done, *_):
        if done == 4:
            for path in (tmp_path / "runs").rglob("*"):
                path.chmod(0o555 if path.is_dir() else 0o444)

    monkeypatch.setattr(driver._Progress, "update", read_only_after_update_4)
    with pytest.raises(OutputError) as error:  # the command line: one line, exit 1
        train(tmp_path, updates_per_chunk=2)
    run_dir = only_run_dir(tmp_path / "runs")
    (line,) = str(error.value).splitlines()
    assert line.startswith(f"could not write {run_dir}/")
    assert line.endswith(
        f"Permission denied; the checkpoint of update 4 is intact: --resume {run_dir} continues from it"
    )
    for path in (tmp_path / "runs").rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    monkeypatch.undo()
    assert train(tmp_path, resume=str(run_dir))["resumed_from_update"] == 4


def test_runs_dir_that_cannot_hold_a_run_is_refused_before_anything_is_written(
    tmp_path, monkeypatch
):
    def run(runs_dir):
        config = StubConfig(runs_dir=str(runs_dir), progress=False)
        return run_training(config, make_stub(), stub_validate)

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^--runs-dir '.*/file' is a file, not a directory$"):
        run(tmp_path / "file")
    with pytest.raises(ConfigError, match=r"^--runs-dir '.*/file/runs': Not a directory$"):
        run(tmp_path / "file" / "runs")
    (tmp_path / "runs").mkdir()
    with monkeypatch.context() as patch:  # the disk fills between mkdir and config.json
        patch.setattr(logs, "open", disk_full, raising=False)
        with pytest.raises(
            ConfigError, match=r"^--runs-dir .*: could not write .*config\.json: No space left"
        ):
            run(tmp_path / "runs")
    assert not any((tmp_path / "runs").iterdir())  # no half-made run directory is left
    if os.geteuid() != 0:  # root writes into read-only directories
        (tmp_path / "runs").chmod(0o555)
        with pytest.raises(ConfigError, match=r"^--runs-dir '.*/runs': Permission denied$"):
            run(tmp_path / "runs")
        assert not any((tmp_path / "runs").iterdir())


def test_resume_of_a_run_directory_it_cannot_write_is_refused(tmp_path):
    run_dir = Path(train(tmp_path, updates_per_chunk=2)["run_dir"])
    (run_dir / "summary.json").unlink()
    (run_dir / ".lock").mkdir()  # as root, a directory is what open(..., "w") cannot write
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    with pytest.raises(ConfigError, match=r"^cannot write .*\.lock: Is a directory$"):
        train(tmp_path, resume=str(run_dir))
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before


# ---------------------------------------------------------------------------------------------
# Re-evaluating a finished run
# ---------------------------------------------------------------------------------------------


def without_evaluation(summary: dict) -> dict:
    """The summary without its evaluation (eval_* keys, the sweep ranking's too): the
    training's figures, seconds included."""

    def training(fields):
        return {k: v for k, v in fields.items() if not k.startswith("eval_")}

    rest = training(summary)
    if "sweep" in rest:
        rest["sweep"] = {
            **rest["sweep"],
            "ranking": [training(r) for r in rest["sweep"]["ranking"]],
        }
    return rest


def with_wrong_eval_returns(summary: dict) -> dict:
    """A copy whose eval_return_* numbers are all 0: a re-evaluation must compute its own."""
    summary = json.loads(json.dumps(summary))
    for fields in [summary, *summary.get("sweep", {}).get("ranking", [])]:
        for key, value in fields.items():
            if key.startswith("eval_return_"):
                fields[key] = [0.0] * len(value) if isinstance(value, list) else 0.0
    return summary


@pytest.mark.parametrize("evaluate_in_chunks", [False, True], ids=["after-training", "in-chunks"])
def test_resume_of_a_finished_run_with_an_evaluation_size_evaluates_it_again(
    tmp_path, capsys, evaluate_in_chunks
):
    make_train = make_stub(evaluate_in_chunks=evaluate_in_chunks)
    run_dir = Path(train(tmp_path, make_train, num_seeds=2, sweep=("rate=0.1,0.5",))["run_dir"])
    trained = json.loads((run_dir / "summary.json").read_text())
    damaged = with_wrong_eval_returns(trained)
    (run_dir / "summary.json").write_text(json.dumps(damaged))
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != "summary.json"}
    capsys.readouterr()

    args = ["--resume", str(run_dir), "--eval-episodes", "3"]
    config = parse_config(StubConfig, {}, args, preset_key=str)
    summary = run_training(config, make_train, stub_validate)
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert line.startswith("stub stub: re-evaluated update 8 with --eval-episodes 3: ")
    assert line.endswith(f"-> {run_dir}")
    assert summary == json.loads((run_dir / "summary.json").read_text())
    assert without_evaluation(summary) == without_evaluation(trained)
    assert summary["eval_episodes"] == 3
    x = [m["episode_return"] for m in trained["final_metrics_per_seed"]]  # the final states'
    ranking = summary["sweep"]["ranking"]
    of_config = [slice(2 * r["config"], 2 * r["config"] + 2) for r in ranking]
    if evaluate_in_chunks:
        assert summary["eval_metrics_per_seed"] == [{"eval_x": v} for v in x]
        for r, runs in zip(ranking, of_config, strict=True):
            assert r["eval_metrics_per_seed"] == [{"eval_x": v} for v in x[runs]]
    else:
        assert summary["eval_return_per_seed"] == pytest.approx(x)
        assert summary["eval_return_mean"] == pytest.approx(np.mean(x))
        for r, runs in zip(ranking, of_config, strict=True):
            assert r["eval_return_per_seed"] == pytest.approx(x[runs])
            assert r["eval_return_mean"] == pytest.approx(np.mean(x[runs]))
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != "summary.json"}
    assert after == before
