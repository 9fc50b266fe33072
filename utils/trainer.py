"""The contract between a trainer script and the driver, in one place.

A trainer script (`purejaxrl_*.py`) provides four things:

- `Config`: a dataclass that extends `utils.cli.RunConfig`; every field is a flag.
- `HyperParams`: a NamedTuple of the hyperparameters that change no array shape. Each field is
  named after the `Config` field it comes from, so that `--sweep` can vary it inside one
  compiled program: the values travel in the training state as arrays (int32 where the
  `Config` field is an int, float32 otherwise), in the HyperParams that `init` was given.
  The driver's programs make each field that every run shares a constant of the program
  (`hyperparams_as_constants`); the fields a sweep varies stay arrays.
- `validate(config, runtime)`: raises `ConfigError` (one sentence) for a bad config. It is
  cheap, builds no network and compiles nothing; the driver calls it for the config and for
  every sweep configuration before anything is written.
- `make_train(config, runtime) -> Trainer`: builds the pure functions, given a valid config.

The driver resolves a `Runtime` (devices, runs side by side, backend) and hands it in; it
never mutates the config. It hands `make_train` a view of the config in which the
`HyperParams` fields cannot be read, except through `hyperparams_of`: compiled code that read
`config.gamma` instead of `hp.gamma` would turn `--sweep gamma=...` into a silent no-op, so the
driver refuses such a trainer, naming the field, before it compiles anything.

After every chunk the driver's divergence guard looks, on the host, at the metrics the
trainer names in `Trainer.guarded_metrics` (its losses) and at the floating-point leaves of
`Trainer.guarded_state(state)` (its parameters and optimiser state): a run in which one turned
NaN or inf stops there, keeps its last finite checkpoint and exits with code 3, unless
--allow-nonfinite. Nothing is added to the compiled chunk.

`Trainer.train(key)` is the whole run without the driver and without a device axis, as
PureJaxRL's `train` is: `jax.jit(jax.vmap(make_train(config).train))(keys)` trains one seed per
key.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from utils.devices import DEVICE_AXIS


class Runtime(NamedTuple):
    """What the driver resolves before it builds a trainer."""

    num_devices: int = 1  # devices the environments are split over, every process together
    num_runs: int = 1  # runs side by side on each device: seeds x sweep configurations
    backend: str = "cpu"  # jax.default_backend()


class TrainerContractError(RuntimeError):
    """A trainer that breaks the contract above: a bug in the trainer, not a bad flag."""


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What `make_train(config, runtime)` returns: pure functions and what the driver reports.

    Under the driver every function runs inside `pmap(vmap(f), axis_name=DEVICE_AXIS)`, so it
    sees one run (one seed of one sweep configuration) on one device. Metrics are already
    reduced over DEVICE_AXIS (`device_mean` / `device_sum`): the driver logs device 0's copy.
    """

    algo: str
    env_id: str
    num_updates: int
    steps_per_update: int  # env steps (or moves) of one run per update, all devices together
    # the base config's values (`hyperparams_of(HyperParams, config)`): the driver stacks one
    # per sweep configuration, and `train` uses these
    hyperparams: Any
    init: Callable  # (key, hyperparams) -> state
    # (state, num_updates, num_active=None) -> (state, {name: [num_updates] float}); NaN means
    # "nothing to report at this update" (no episode ended, no evaluation ran). Outputs named
    # "record_*" have any shape and go to `write_records` instead of metrics.csv. `num_active`,
    # where given, is a traced int32 in [1, num_updates]: only the first num_active updates
    # train (`scan_updates` does both), so that a run's last, shorter chunk runs the program of
    # the others and compiles nothing.
    train_chunk: Callable
    # (state, key) -> episode returns [episodes], run once after training; None for no
    # evaluation then (--eval-episodes 0, or a trainer that evaluates after every chunk)
    evaluate: Callable | None
    runtime: Runtime  # what the trainer was built for
    # (state) -> utils.evaluation.Policy: the policy whose episode is filmed after training
    # (--capture-video); None for no video
    video_policy: Callable | None = None
    # (run_dir, update, records) -> written files, on the host after a chunk with records
    write_records: Callable | None = None
    headline_metric: str = "episode_return"  # the progress bar's number and the final value
    step_unit: str = "steps"  # what steps_per_update counts, for the reports
    updates_per_chunk: int | None = None  # a chunk length the algorithm needs (None: free)
    # A hint the driver applies before lowering: JAX's threefry hash as straight-line code on
    # CPU (utils.devices.unroll_threefry_on_cpu), or JAX's rolled CPU loop. PPO, DQN and
    # AlphaZero keep the loop: it compiles faster and they train as fast or faster with it.
    unrolled_threefry: bool = False
    # The divergence guard's inputs (--allow-nonfinite turns it off). Metrics that a healthy
    # run keeps finite once it reports them (the losses; NaN before that is "nothing to report
    # yet", as DQN's loss before learning starts) ...
    guarded_metrics: tuple[str, ...] = ()
    # ... and (state) -> the part of the state that must stay finite (parameters, optimiser
    # state; not replay buffers or environments): the driver checks its floating-point leaves
    # after every chunk. None checks none.
    guarded_state: Callable | None = None
    # (state) -> {name: scalar, "record_*": any shape}: the evaluation that ends every chunk
    # (AlphaZero's; its `evaluate` is None). The driver runs it on each chunk's final state as
    # a program of its own, compiled beside the chunk's, and logs each value at the chunk's
    # last update (`at_last_update`); it runs it alone on the final state when a finished run
    # is evaluated again (--resume with --eval-games). Its randomness comes from the state
    # without advancing it: evaluating changes nothing that training does, and the final state
    # plays the games of the last chunk's evaluation again. None: no such evaluation.
    chunk_evaluation: Callable | None = None

    def train(self, key):
        """The whole run as one scan over updates, with no driver: (final state, metrics
        {name: [num_updates]}). The device axis the functions expect has size 1."""
        if self.runtime.num_devices != 1:
            raise TrainerContractError(
                f"Trainer.train runs on one device; this trainer was built for "
                f"{self.runtime.num_devices}"
            )

        def whole_run(key):
            state, metrics = self.train_chunk(self.init(key, self.hyperparams), self.num_updates)
            if self.chunk_evaluation is not None:
                last = self.num_updates - 1
                metrics |= at_last_update(self.chunk_evaluation(state), self.num_updates, last)
            return state, metrics

        out = jax.vmap(whole_run, axis_name=DEVICE_AXIS)(key[None])
        return jax.tree.map(lambda x: x[0], out)


def scan_updates(update_step: Callable, state, num_updates: int, num_active=None):
    """`jax.lax.scan(update_step, state, None, num_updates)`: the body of a `train_chunk`.

    With `num_active` (a traced int32 in [1, num_updates]) only the first num_active updates
    run, in a loop of the same body, and the outputs of the others are NaN (zero where not
    floating-point). The update is traced once: `jax.jit` caches its trace between the shape
    query and the loop. Scalar outputs leave the loop stacked by dtype (`_scalars_stacked`)."""
    update_step, unpack = _scalars_stacked(update_step)
    if num_active is None:
        state, outs = jax.lax.scan(update_step, state, None, num_updates)
        return state, unpack(outs)
    update_step = jax.jit(update_step)
    out_shapes = jax.eval_shape(update_step, state, None)[1]

    def empty(shape):
        fill = jnp.nan if jnp.issubdtype(shape.dtype, jnp.inexact) else 0
        return jnp.full((num_updates, *shape.shape), fill, shape.dtype)

    def _one_update(i, carry):
        state, outs = carry
        state, out = update_step(state, None)
        return state, jax.tree.map(lambda o, x: o.at[i].set(x), outs, out)

    outs = jax.tree.map(empty, out_shapes)
    state, outs = jax.lax.fori_loop(0, num_active, _one_update, (state, outs))
    return state, unpack(outs)


def _scalars_stacked(update_step: Callable) -> tuple[Callable, Callable]:
    """`update_step` with its scalar outputs of each dtype stacked into one vector, so that a
    scan writes one array per dtype and update instead of one per metric (on a TPU each write
    is a kernel of its own); and the function that turns the scan's stacked outputs back into
    `update_step`'s structure. The structure is read when the scan traces the step."""
    layout = {}

    def packed_step(state, x):
        state, out = update_step(state, x)
        leaves, layout["treedef"] = jax.tree.flatten(out)
        scalars, others, layout["places"] = {}, [], []
        for leaf in map(jnp.asarray, leaves):
            if leaf.ndim == 0:
                group = scalars.setdefault(leaf.dtype.name, [])
                layout["places"].append((leaf.dtype.name, len(group)))
                group.append(leaf)
            else:
                layout["places"].append((None, len(others)))
                others.append(leaf)
        return state, ({name: jnp.stack(group) for name, group in scalars.items()}, others)

    def unpack(packed):
        scalars, others = packed
        leaves = [
            others[i] if name is None else scalars[name][:, i] for name, i in layout["places"]
        ]
        return jax.tree.unflatten(layout["treedef"], leaves)

    return packed_step, unpack


def at_last_update(evaluation: dict, num_updates: int, last) -> dict:
    """A chunk evaluation's outputs (`Trainer.chunk_evaluation`) as chunk metrics: each scalar
    at update index `last` (an int, or a traced int32) of [num_updates] and NaN at the others,
    "nothing to report" there; "record_*" outputs as they are."""
    nan = jnp.full(num_updates, jnp.nan, jnp.float32)
    return {
        name: value if name.startswith("record_") else nan.at[last].set(value.astype(jnp.float32))
        for name, value in evaluation.items()
    }


def hyperparams_of(hyperparams_type: type, config) -> Any:
    """The `HyperParams` of a config (or of the driver's view of one): each field from the
    `Config` field of the same name, int32 for an int field and float32 otherwise."""
    config = config._config if isinstance(config, ConfigView) else config
    # the declared type, not the value's: a preset may write a float field as 1
    declared = {field.name: field.type for field in dataclasses.fields(config)}
    unknown = [name for name in hyperparams_type._fields if name not in declared]
    if unknown:
        raise TrainerContractError(
            f"HyperParams fields {unknown} are not Config fields: each must be named after one"
        )
    return hyperparams_type(
        **{
            name: np.asarray(
                getattr(config, name), np.int32 if declared[name] in ("int", int) else np.float32
            )
            for name in hyperparams_type._fields
        }
    )


def hyperparams_as_constants(state, run_hyperparams):
    """One run's `state`, inside a traced program, with each field of its HyperParams that
    every run shares (`run_hyperparams`, leaves [runs]) replaced by that value as a constant of
    the program, so that XLA folds it into the arithmetic it feeds (a learning rate, a period
    that divides an env step counter). A field a sweep varies keeps the run's array."""
    kind = type(run_hyperparams)
    shared = {
        name: values[0]
        for name, values in run_hyperparams._asdict().items()
        if (values == values[0]).all()
    }

    def fold(node):
        if not isinstance(node, kind):
            return node
        return node._replace(**{name: jnp.asarray(value) for name, value in shared.items()})

    return jax.tree.map(fold, state, is_leaf=lambda node: isinstance(node, kind))


class ConfigView:
    """A config as `make_train` sees it under the driver. Reading a field records it; once the
    trainer names its `HyperParams` (`hide`), reading one of those raises, and the driver
    refuses a trainer that read one while it was built (`check_reads`)."""

    def __init__(self, config):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_read", set())
        object.__setattr__(self, "_hidden", frozenset())

    def __getattr__(self, name):
        if name in self._hidden:
            raise TrainerContractError(_read_message(name))
        self._read.add(name)
        return getattr(self._config, name)

    def __setattr__(self, name, value):
        raise TrainerContractError(f"make_train set config.{name}; the config is never mutated")

    def hide(self, names) -> None:
        object.__setattr__(self, "_hidden", frozenset(names))

    def check_reads(self, names) -> None:
        for name in names:
            if name in self._read:
                raise TrainerContractError(_read_message(name))


def _read_message(name: str) -> str:
    return (
        f"the trainer read config.{name}, a HyperParams field that --sweep varies inside the "
        f"compiled program; read it from the HyperParams in the training state (hp.{name})"
    )


def build_trainer(make_train: Callable, config, runtime: Runtime) -> Trainer:
    """`make_train(config, runtime)` under the contract: the config's HyperParams fields are
    unreadable to it and to the functions it returns, and its `train_chunk` takes
    `num_active`."""
    view = ConfigView(config)
    trainer = make_train(view, runtime)
    fields = type(trainer.hyperparams)._fields
    view.check_reads(fields)
    view.hide(fields)
    try:
        inspect.signature(trainer.train_chunk).bind(None, 1, 1)
    except TypeError:
        raise TrainerContractError(
            "train_chunk must take (state, num_updates, num_active=None): the driver runs a "
            "run's shorter last chunk with the other chunks' program (utils.trainer.scan_updates)"
        ) from None
    return trainer


def check_chunk_metrics(metrics: dict, num_updates: int, guarded: tuple[str, ...] = ()) -> None:
    """The metrics of a chunk on the host, leaves [runs, num_updates] (device 0's copy): one
    float per update and run for every name but the "record_*" outputs, and every guarded
    metric among them."""
    for name, values in metrics.items():
        if name.startswith("record_"):
            continue
        if values.ndim != 2 or values.shape[1] != num_updates:
            raise TrainerContractError(
                f"metric {name!r} has shape {values.shape[1:]} per run; a chunk of "
                f"{num_updates} updates must give one value per update, shape ({num_updates},)"
            )
    missing = [name for name in guarded if name not in metrics]
    if missing:
        raise TrainerContractError(f"guarded_metrics {missing} are not metrics of the chunk")
