"""The training driver every trainer shares: compiled chunks, logs, checkpoints, summary.

`run_training(config, make_train, validate)` runs a trainer script's functions under the
contract of utils/trainer.py, in four stages that read top to bottom:

1. `plan_runs`: flags checked, devices resolved, trainer built, sweep and seeds laid out, run
   directory created.
2. `start_or_resume`: the initial state on the devices, or the latest checkpoint, while the
   first chunk's program compiles in a background thread (`_ChunkRunner.start_compiling`).
3. `train_in_chunks`: `train_chunk` (a `lax.scan` over updates) under `pmap(vmap(...))`,
   devices on the outer axis, runs on the inner one, one compiled program for every chunk
   (and a second one for a trainer's chunk evaluation, run on each chunk's final state).
   Between chunks, and only there, the host writes metrics.csv, wandb, the progress bar and
   an atomic checkpoint, while the devices already train the next chunk. With a single chunk
   the whole run is exactly one scan.
4. `report`: evaluation, video, the learning curve, summary.json (last) and the one-line result.

`reevaluate` runs the final evaluation of a finished run again (--resume with --eval-episodes
or --eval-games) and replaces only summary.json's evaluation fields.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import functools
import itertools
import math
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from utils import checkpoint, interrupts
from utils.cli import EVAL_SIZE_FIELDS
from utils.devices import (
    DEVICE_AXIS,
    compile_for_one_call,
    process_group,
    resolve_num_devices,
    split_cpu_host,
    unroll_threefry_on_cpu,
    use_compile_cache,
)
from utils.errors import ConfigError, OutputError
from utils.logs import (
    MetricsCsv,
    WandbSink,
    naming_the_file,
    read_json,
    read_metrics_csv,
    write_json,
)
from utils.plotting import plot_learning_curve
from utils.sweep import config_label, num_configs, sweep_configs
from utils.trainer import (
    Runtime,
    Trainer,
    at_last_update,
    build_trainer,
    check_chunk_metrics,
    hyperparams_as_constants,
    hyperparams_of,
)
from utils.video import write_episode_gif

CHUNKS_PER_RUN = 25  # automatic chunking aims at about this many progress/checkpoint points
# a run whose losses or parameters turned NaN or inf exits with this (--allow-nonfinite)
DIVERGED_EXIT_CODE = 3
# every process of a multi-process run meets here once process 0 has written its report
_REPORTED_BARRIER = "purejaxrl run reported"


def auto_updates_per_chunk(num_updates: int) -> int:
    """A chunk length near num_updates / CHUNKS_PER_RUN that divides num_updates if one is
    close, so that every chunk has the same length and compiles once."""
    target = max(1, round(num_updates / CHUNKS_PER_RUN))
    shortest, longest = max(1, target // 2), 2 * target
    # A length d divides num_updates where the chunk count num_updates // d does: searching the
    # few counts instead of the lengths keeps this instant for any --total-timesteps.
    counts = range(-(-num_updates // longest), num_updates // shortest + 1)
    divisors = sorted(num_updates // q for q in counts if num_updates % q == 0)
    return min(divisors, key=lambda d: abs(d - target)) if divisors else target


def _over_runs(f: Callable, num_runs: int, in_axes=0) -> Callable:
    """`jax.vmap(f, in_axes)` over the leading run axis (seeds x sweep configurations). A
    single run goes unbatched and gets its axis back: a size-1 vmap still batches every gather
    and scatter (mctx's tree updates, for one), which slows AlphaZero's self-play on CPU
    (docs/benchmarks.md)."""
    if num_runs > 1:
        return jax.vmap(f, in_axes=in_axes)

    def single_run(*args):
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        args = [
            a if axis is None else jax.tree.map(lambda x: x[0], a)
            for a, axis in zip(args, axes, strict=True)
        ]
        return jax.tree.map(lambda x: x[None], f(*args))

    return single_run


def _available_bytes() -> int:
    """Memory of one device: the accelerator's, or this host's RAM for the CPU backend."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _init_program(trainer: Trainer) -> Callable:
    """pmap over this process's devices of the runs' initial states: (keys [devices, runs, 2],
    hyperparams, leaves [devices, runs]) -> state, leaves [devices, runs, ...]. Runs are
    initialised one after another (lax.map), not vmapped: a batched LAPACK QR, as in
    orthogonal weight init, can deadlock XLA:CPU's thread pool on small machines."""
    return jax.pmap(
        lambda keys, hyperparams: jax.lax.map(lambda run: trainer.init(*run), (keys, hyperparams)),
        axis_name=DEVICE_AXIS,
    )


def _state_shapes(init_program: Callable, trainer: Trainer, num_runs: int, local_devices: int):
    """The training state's shapes, leaves [local devices, runs, ...], from tracing
    `init_program` on abstract inputs: nothing is allocated, and the initial state's
    compilation reuses this trace instead of tracing `init` again."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            (local_devices, num_runs, *np.shape(x)), np.asarray(x).dtype
        ),
        (jax.random.PRNGKey(0), trainer.hyperparams),
    )
    return jax.eval_shape(init_program, *abstract)


def _check_memory(state_shapes, num_runs: int, local_devices: int) -> None:
    """Refuse, with the estimate, a training state (`_state_shapes`) that cannot fit: on the
    CPU backend all devices share this host's memory."""
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state_shapes))
    per_run = total / (num_runs * local_devices)
    needed = total if jax.default_backend() == "cpu" else total / local_devices
    available = _available_bytes()
    if needed > available:
        raise ConfigError(
            f"the training state needs about {needed / 2**30:,.1f} GiB ({per_run / 2**20:,.1f} "
            f"MiB per run x {num_runs} runs), more than the {available / 2**30:,.1f} GiB of "
            f"{'this host' if jax.default_backend() == 'cpu' else 'a device'}"
        )


def check_run_config(config) -> None:
    if config.num_seeds < 1:
        raise ConfigError(f"--num-seeds must be >= 1, got {config.num_seeds}")
    last_seed = config.seed + config.num_seeds - 1
    if config.seed < 0 or last_seed > 2**31 - 1:
        raise ConfigError(
            f"--seed {config.seed} with --num-seeds {config.num_seeds}: seeds must lie in "
            f"[0, {2**31 - 1}]"
        )
    if config.updates_per_chunk < 0:
        raise ConfigError(f"--updates-per-chunk must be >= 0, got {config.updates_per_chunk}")
    if config.checkpoint_every < 0:
        raise ConfigError(f"--checkpoint-every must be >= 0, got {config.checkpoint_every}")
    if config.keep_checkpoints < 0:
        raise ConfigError(f"--keep-checkpoints must be >= 0, got {config.keep_checkpoints}")


def _new_run_dir(config, trainer: Trainer) -> str:
    """A fresh run directory with config.json. Created atomically: two launches in the same
    second (a parallel sweep) get a name each, with a suffix. A runs dir that cannot hold it is
    a ConfigError, and leaves nothing behind."""
    name = f"{trainer.env_id}__{trainer.algo}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    if os.path.isfile(config.runs_dir):
        raise ConfigError(f"--runs-dir {config.runs_dir!r} is a file, not a directory")
    try:
        os.makedirs(config.runs_dir, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"--runs-dir {config.runs_dir!r}: {error.strerror}") from None
    for suffix in itertools.count(1):
        run_dir = os.path.join(config.runs_dir, name if suffix == 1 else f"{name}-{suffix}")
        try:
            os.mkdir(run_dir)
            break
        except FileExistsError:
            continue
        except OSError as error:
            raise ConfigError(f"--runs-dir {config.runs_dir!r}: {error.strerror}") from None
    try:
        write_json(os.path.join(run_dir, "config.json"), dataclasses.asdict(config))
        # what made the run, so that --resume can refuse another trainer's directory
        write_json(
            os.path.join(run_dir, "run.json"), {"algo": trainer.algo, "env_id": trainer.env_id}
        )
    except OSError as error:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise ConfigError(
            f"--runs-dir {config.runs_dir!r}: could not write {error.filename}: {error.strerror}"
        ) from None
    return run_dir


def _check_resumable(config, trainer: Trainer) -> int | None:
    """--resume: the checkpoint's update (None: none yet, the run starts over), after refusing
    another trainer's directory."""
    saved_algo = trainer.algo  # run directories from before run.json existed: unchecked
    if os.path.exists(os.path.join(config.resume, "run.json")):
        saved = read_json(os.path.join(config.resume, "run.json"), "--resume")
        saved_algo = saved.get("algo", trainer.algo)
    if saved_algo != trainer.algo:
        raise ConfigError(
            f"--resume: {config.resume!r} is a {saved_algo} run, not a {trainer.algo} one"
        )
    return checkpoint.latest_update(os.path.join(config.resume, "checkpoints"))


@contextlib.contextmanager
def _run_lock(run_dir: str | None):
    """Holds RUN_DIR/.lock for the run's lifetime: a second process on the same run directory
    (two --resume at once) gets one sentence instead of racing the first one's files. A file
    of the run that cannot be written (a full disk, a read-only directory) becomes an
    OutputError: one sentence with the file, the error and how to resume."""
    if run_dir is None:
        yield
        return
    path = os.path.join(run_dir, ".lock")
    with _open_to_write(path) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"{run_dir!r} is in use by another training process") from None
        try:
            yield
        except OSError as error:
            raise OutputError(_failed_write(run_dir, error)) from None
        finally:
            # gone when an interrupted new run removed it all; stays where nothing can be written
            with contextlib.suppress(OSError):
                os.unlink(path)


def _open_to_write(path: str):
    """`open(path, "w")`, or a ConfigError: the run directory cannot be written."""
    try:
        return open(path, "w")
    except OSError as error:
        raise ConfigError(f"cannot write {path}: {error.strerror}") from None


def _failed_write(run_dir: str, error: OSError) -> str:
    """The sentence for a failed write: the file, the error, and what --resume does next."""
    failed = f"could not write {error.filename}: {error.strerror or error}"
    if error.filename is None:
        failed = f"a write failed: {error.strerror or error}"
    update = checkpoint.latest_update(os.path.join(run_dir, "checkpoints"))
    if update is None:
        return f"{failed}; {run_dir} has no checkpoint yet: --resume {run_dir} starts it over"
    return (
        f"{failed}; the checkpoint of update {update} is intact: --resume {run_dir} continues "
        "from it"
    )


class _Progress:
    """Progress after every chunk: a rich bar on a terminal (updates done, the headline metric,
    steps/s, ETA); where stdout is not one (SLURM, nohup, CI), one plain line per chunk."""

    def __init__(self, enabled: bool, total: int, done: int, label: str, trainer: Trainer):
        self.bar, self.plain = None, enabled and not sys.stdout.isatty()
        self.total, self.first, self.label, self.trainer = total, done, label, trainer
        self.start = time.perf_counter()
        if not enabled or self.plain:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} updates"),
            TextColumn(f"{trainer.headline_metric.replace('_', ' ')} {{task.fields[ret]}}"),
            TextColumn(f"{{task.fields[sps]}} {trainer.step_unit}/s"),
            TextColumn("ETA"),
            TimeRemainingColumn(),
        )
        self.task = self.bar.add_task(label, total=total, completed=done, ret="-", sps="-")
        self.bar.start()

    def update(self, done: int, mean_return: float, steps_per_second: float):
        ret = "-" if math.isnan(mean_return) else f"{mean_return:.3g}"
        if self.bar is not None:
            self.bar.update(self.task, completed=done, ret=ret, sps=f"{steps_per_second:,.0f}")
        elif self.plain:
            per_update = (time.perf_counter() - self.start) / max(done - self.first, 1)
            trainer = self.trainer
            print(
                f"{self.label}: update {done}/{self.total}, "
                f"{done * trainer.steps_per_update:,} {trainer.step_unit}, "
                f"{trainer.headline_metric} {ret}, {steps_per_second:,.0f} {trainer.step_unit}/s, "
                f"ETA {per_update * (self.total - done):.0f} s",
                flush=True,
            )

    def close(self):
        if self.bar is not None:
            self.bar.stop()


def _run_of_rows(columns: dict, num_seeds: int) -> np.ndarray:
    """The run index of every metrics.csv row: configuration-major, as the runs are vmapped."""
    return columns["seed"] + num_seeds * columns.get("config", 0)


def _final_values(
    columns: dict, metric: str, num_seeds: int, num_runs: int, num_updates: int
) -> list[float]:
    """Per run: the metric's mean over the last 10% of updates (the updates that reported
    it), or its last reported value if it was reported less often than that."""
    window_start = num_updates - max(1, num_updates // 10)
    row_run = _run_of_rows(columns, num_seeds)
    finals = []
    for run in range(num_runs):
        of_run = row_run == run
        values = columns[metric][of_run & (columns["update"] > window_start)]
        values = values[np.isfinite(values)]
        if not values.size:
            values = columns[metric][of_run]
            values = values[np.isfinite(values)][-1:]
        finals.append(float(values.mean()) if values.size else float("nan"))
    return finals


def _last_reported(
    columns: dict, metric_names: list[str], num_seeds: int, num_runs: int
) -> list[dict[str, float]]:
    """Per run: the last finite value of every metric (NaN if it never reported one). The
    rows are in the order they were trained; one pass per metric over all runs' rows."""
    row_run = _run_of_rows(columns, num_seeds).astype(np.int64)
    last = [{} for _ in range(num_runs)]
    for name in metric_names:
        (rows,) = np.nonzero(np.isfinite(columns[name]))
        last_row = np.full(num_runs, -1)
        np.maximum.at(last_row, row_run[rows], rows)
        for run, row in enumerate(last_row):
            last[run][name] = float(columns[name][row]) if row >= 0 else float("nan")
    return last


def _mean_and_std(finals: list[float]) -> tuple[float, float]:
    """Mean and standard deviation of the runs' final values, leaving out runs with none (NaN:
    no episode ended in a short run); NaN and NaN if no run has one, without NumPy's warning
    about an empty mean reaching the user's terminal."""
    values = np.asarray(finals, dtype=float)
    values = values[~np.isnan(values)]
    if not values.size:
        return float("nan"), float("nan")
    return float(values.mean()), float(values.std())


def _sweep_ranking(overrides: list[dict], finals: list[float], evals: list[float]) -> list[dict]:
    """One entry per configuration, best mean final value first (NaN last), with the spread
    over its seeds."""
    num_seeds = len(finals) // len(overrides)
    ranking = []
    for k, values in enumerate(overrides):
        of_config = slice(k * num_seeds, (k + 1) * num_seeds)
        config_finals, config_evals = finals[of_config], evals[of_config]
        final_mean, final_std = _mean_and_std(config_finals)
        ranking.append(
            {
                "config": k,
                "hyperparams": values,
                "final_mean": final_mean,
                "final_std": final_std,
                "final_per_seed": config_finals,
                "eval_return_mean": float(np.mean(config_evals)),
                "eval_return_per_seed": config_evals,
            }
        )
    return sorted(
        ranking,
        key=lambda r: -r["final_mean"] if np.isfinite(r["final_mean"]) else np.inf,
    )


# ---------------------------------------------------------------------------------------------
# The run, in four stages: plan -> start or resume -> chunks -> report
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """Everything decided before the first array is made: the runs side by side (sweep
    configurations x seeds, configuration-major), the devices and where outputs go."""

    config: Any  # as parsed; never mutated
    trainer: Trainer
    overrides: list[dict]  # {field: value} of each sweep configuration; [{}] without a sweep
    run_seed: np.ndarray  # [runs] seed index of each run
    run_config: np.ndarray  # [runs] sweep configuration of each run
    run_keys: np.ndarray  # [runs, 2] PRNG key of each run: seed + its seed index
    run_hyperparams: Any  # HyperParams, leaves [runs]
    run_columns: dict  # metrics.csv columns that name a run, one list entry per run
    local_devices: int  # the pmapped axis of this process
    init_program: Callable  # `_init_program`: the initial state of every run
    state_shapes: Any  # the training state's shapes, leaves [local_devices, runs, ...]
    multi_process: bool
    is_main: bool  # process 0, the only one that writes
    run_dir: str | None  # None on the other processes
    chunk_len: int
    resume_update: int | None  # --resume: the checkpoint's update (None: none, start over)

    @property
    def num_runs(self) -> int:
        return len(self.run_seed)

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def csv_path(self) -> str:
        return os.path.join(self.run_dir, "metrics.csv")


@dataclasses.dataclass
class _Clock:
    """Seconds spent so far, including those of the run before a resume (`previous`)."""

    wall_start: float
    compile_seconds: float = 0.0
    # from each chunk's launch to its results on the host, the writing of the chunk before it
    # included where it outlasts the devices' training
    train_seconds: float = 0.0
    previous: dict = dataclasses.field(
        default_factory=lambda: {"train_seconds": 0.0, "compile_seconds": 0.0, "wall_seconds": 0.0}
    )
    # `totals` at the end of every chunk this process trained, after its logs and any checkpoint:
    # when a metric first reached a value (benchmarks/time_to_skill.py)
    chunk_ends: list = dataclasses.field(default_factory=list)

    def totals(self, update: int) -> dict:
        """The checkpoint's meta: the update and the run's seconds so far."""
        return {
            "update": update,
            "train_seconds": self.previous["train_seconds"] + self.train_seconds,
            "compile_seconds": self.previous["compile_seconds"] + self.compile_seconds,
            "wall_seconds": self.previous["wall_seconds"] + time.perf_counter() - self.wall_start,
        }


def plan_runs(config, make_train: Callable, validate: Callable) -> RunPlan:
    """Check the flags, resolve the devices, build the trainer, lay out the sweep and seeds, and
    (process 0, new runs) create the run directory. Raises ConfigError before writing anything."""
    check_run_config(config)
    split_cpu_host(config.cpu_devices, process_group(config))  # may restart the process
    use_compile_cache(config.compile_cache)
    multi_process, is_main = jax.process_count() > 1, jax.process_index() == 0
    if multi_process and config.resume is not None:
        raise ConfigError(
            "--resume of a multi-process run is not supported: its checkpoint holds process "
            "0's environments only"
        )
    runtime = Runtime(
        num_devices=resolve_num_devices(config.num_devices),
        num_runs=config.num_seeds * num_configs(config.sweep),
        backend=jax.default_backend(),
    )
    validate(config, runtime)
    trainer = build_trainer(make_train, config, runtime)
    overrides = sweep_configs(config, trainer.hyperparams._fields)
    swept = [dataclasses.replace(config, **values) for values in overrides]
    for values, swept_config in zip(overrides, swept, strict=True):
        if values:  # every sweep configuration gets the trainer's own checks
            validate(swept_config, runtime)
    config_hyperparams = [hyperparams_of(type(trainer.hyperparams), c) for c in swept]
    num_configs_, num_seeds = len(overrides), config.num_seeds
    local_devices = runtime.num_devices // jax.process_count()
    init_program = _init_program(trainer)
    state_shapes = _state_shapes(init_program, trainer, num_configs_ * num_seeds, local_devices)
    _check_memory(state_shapes, num_configs_ * num_seeds, local_devices)
    run_seed = np.tile(np.arange(num_seeds), num_configs_)
    run_config = np.repeat(np.arange(num_configs_), num_seeds)
    run_columns = {"seed": run_seed.tolist()}
    if config.sweep:
        run_columns["config"] = run_config.tolist()
        for name in overrides[0]:
            run_columns[name] = [overrides[k][name] for k in run_config]
    # Configuration k with seed index i starts exactly as a single run with seed + i would.
    run_keys = np.stack([np.asarray(jax.random.PRNGKey(config.seed + i)) for i in run_seed])
    run_hyperparams = jax.tree.map(
        lambda *values: np.stack(values)[run_config], *config_hyperparams
    )
    resume_update = None
    if config.resume is not None:
        run_dir, resume_update = config.resume, _check_resumable(config, trainer)
    elif is_main:
        # A stop signal from here on finds the directory, and a second one exits at once: the
        # line that removes it is in place before the signal can see the directory.
        with interrupts.held():
            run_dir = _new_run_dir(config, trainer)
            interrupts.exit_says(functools.partial(_remove_new_run, run_dir))
    else:
        run_dir = None
    return RunPlan(
        config=config,
        trainer=trainer,
        overrides=overrides,
        run_seed=run_seed,
        run_config=run_config,
        run_keys=run_keys,
        run_hyperparams=run_hyperparams,
        run_columns=run_columns,
        local_devices=local_devices,
        init_program=init_program,
        state_shapes=state_shapes,
        multi_process=multi_process,
        is_main=is_main,
        run_dir=run_dir,
        chunk_len=trainer.updates_per_chunk
        or config.updates_per_chunk
        or auto_updates_per_chunk(trainer.num_updates),
        resume_update=resume_update,
    )


def start_or_resume(plan: RunPlan, clock: _Clock, on_state_shapes: Callable | None = None):
    """The initial training state on the devices, leaves [local devices, runs, ...], or the
    latest checkpoint's with --resume. Returns (state, first update to train).
    `on_state_shapes(abstract_state)`, if given, is called with the state's shapes as soon as
    they are known, before the initial state compiles: `_ChunkRunner.start_compiling`."""
    trainer = plan.trainer
    unroll_threefry_on_cpu(trainer.unrolled_threefry)  # before anything is lowered
    # Every device gets the run's key, so network parameters are identical across devices;
    # trainers fold the device index into their environment keys.
    on_every_device = functools.partial(
        jax.tree.map, lambda x: np.repeat(x[None], plan.local_devices, 0)
    )
    start = time.perf_counter()
    init_runs = plan.init_program
    args = on_every_device((plan.run_keys, plan.run_hyperparams))
    if not plan.multi_process:  # a compiled pmap takes global arrays only
        lowered = init_runs.lower(*args)
        if on_state_shapes is not None:
            on_state_shapes(plan.state_shapes)
        init_runs = compile_for_one_call(lowered, simple_kernels=True)
    state = jax.block_until_ready(init_runs(*args))
    clock.compile_seconds += time.perf_counter() - start
    if plan.config.resume is None:
        return state, 0
    if plan.resume_update is None:
        print(f"{plan.run_dir} has no checkpoint yet: the run starts over", file=sys.stderr)
        return state, 0
    host_state, meta = checkpoint.restore(plan.checkpoint_dir, state)
    state = jax.tree.map(lambda h, t: jax.device_put(h, t.sharding), host_state, state)
    clock.previous = {k: meta[k] for k in ("train_seconds", "compile_seconds", "wall_seconds")}
    return state, int(meta["update"])


def _in_background(compile_program: Callable) -> concurrent.futures.Future:
    """`compile_program()` in a thread of its own, named compile_*; the future of its result.
    The thread ends once the compilation is done."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile")
    future = pool.submit(compile_program)
    pool.shutdown(wait=False)
    return future


class _Launched(NamedTuple):
    """A chunk running on the devices (`_ChunkRunner.launch`): its outputs, not yet ready."""

    state: Any
    metrics: dict
    finite: jax.Array
    num_updates: int
    started: float  # time.perf_counter() at its launch


class _ChunkRunner:
    """`train_chunk` compiled once, as pmap(vmap(chunk)) over the runs. The same program checks
    the divergence guard's state (`_state_finite`), so that the check costs neither a
    compilation nor a dispatch of its own. Where no chunk length divides the updates left, the
    program takes how many of its updates to run (`num_active`, see utils/trainer.py), and the
    last, shorter chunk runs it too. A trainer's `chunk_evaluation` is a second program, run on
    each chunk's final state. Both can compile in background threads while the initial state
    compiles and runs (`start_compiling`): XLA compiles a program on one core, and the others
    would idle."""

    def __init__(self, plan: RunPlan, clock: _Clock, first_update: int):
        self.plan, self.clock = plan, clock
        trainer = plan.trainer
        # `_programs`, each once it has compiled
        self.compiled: list[Callable | None] = [None] * (1 + bool(trainer.chunk_evaluation))
        self.compiling: list[concurrent.futures.Future] | None = None  # from start_compiling
        # one length from the start, so that a resumed run compiles the program it started with
        self.length = min(plan.chunk_len, trainer.num_updates)
        self.masked = (trainer.num_updates - first_update) % self.length != 0
        self.check_state = trainer.guarded_state is not None and not plan.config.allow_nonfinite

    def start_compiling(self, abstract_state) -> None:
        """Begin compiling from the state's shapes, each program in a thread of its own;
        `launch` waits for each where it first needs it. The chunk evaluation's program is
        traced once the chunk's is lowered: tracing holds the GIL, and the chunk's program is
        needed first. A compiled pmap takes global arrays only: a run of several processes
        compiles at its first launch instead."""
        if self.plan.multi_process:
            return
        args = self._arguments(abstract_state, self.length)
        chunk, *evaluation = self._programs()
        chunk_lowered = threading.Event()

        def compile_chunk():
            try:
                lowered = chunk.lower(*args)
            finally:
                chunk_lowered.set()
            return lowered.compile()

        def compile_evaluation(program):
            chunk_lowered.wait()
            return program.lower(*args).compile()

        self.compiling = [_in_background(compile_chunk)] + [
            _in_background(functools.partial(compile_evaluation, program)) for program in evaluation
        ]

    def _arguments(self, state, num_updates: int) -> tuple:
        return (state, np.int32(num_updates)) if self.masked else (state,)

    def _programs(self) -> list[Callable]:
        """The chunk's program, (state, [num_active]) -> (state, metrics, finite), and with a
        chunk evaluation its program, (the chunk's state, [num_active]) -> metrics."""
        trainer, length, masked = self.plan.trainer, self.length, self.masked

        def chunk_and_check(state, *num_active):
            state = hyperparams_as_constants(state, self.plan.run_hyperparams)
            state, metrics = trainer.train_chunk(state, length, *num_active)
            finite = _state_finite(trainer.guarded_state(state)) if self.check_state else True
            return state, metrics, jnp.asarray(finite)

        def evaluate(state, *num_active):
            last = num_active[0] - 1 if masked else length - 1
            state = hyperparams_as_constants(state, self.plan.run_hyperparams)
            return at_last_update(trainer.chunk_evaluation(state), length, last)

        in_axes = (0, None) if masked else 0
        functions = [chunk_and_check, evaluate] if trainer.chunk_evaluation else [chunk_and_check]
        return [
            jax.pmap(
                _over_runs(function, self.plan.num_runs, in_axes),
                axis_name=DEVICE_AXIS,
                in_axes=in_axes,
            )
            for function in functions
        ]

    def _program(self, index: int, args) -> Callable:
        """Program `index` of `_programs`, compiled; the first time, after waiting for its
        compilation, which the clock counts as compiling."""
        if self.compiled[index] is None:
            start = time.perf_counter()
            if self.compiling is not None:  # a single process: start_or_resume started it
                self.compiled[index] = self.compiling[index].result()
            else:
                # A compiled pmap takes global arrays only; with several processes the pmapped
                # function converts this process's arrays and reuses the compilation.
                program = self._programs()[index]
                program.lower(*args).compile()
                self.compiled[index] = program
            self.clock.compile_seconds += time.perf_counter() - start
            interrupts.check()  # a stop asked for while compiling: before anything more runs
        return self.compiled[index]

    def launch(self, state, num_updates: int) -> _Launched:
        """Start training `num_updates` (the chunk's length, or fewer in a masked program's
        last chunk) from `state`, and the chunk evaluation after them, if the trainer has one.
        The devices run it while the host goes on; `collect` waits for it. The first launch
        waits for the chunk's compilation, then for the evaluation's while the chunk trains."""
        args = self._arguments(state, num_updates)
        chunk = self._program(0, args)
        start = time.perf_counter()
        state, metrics, finite = chunk(*args)
        if self.plan.trainer.chunk_evaluation:
            if self.compiled[1] is None:
                # The evaluation may still compile while the chunk trains: the clock counts
                # the chunk's time as training and only the wait after it as compiling.
                jax.block_until_ready(finite)
                trained = time.perf_counter() - start
                self._program(1, args)
                start = time.perf_counter() - trained
            metrics = {**metrics, **self._program(1, args)(state, *args[1:])}
        return _Launched(state, metrics, finite, num_updates, start)

    def collect(self, launched: _Launched):
        """Wait for a launched chunk: (new state, metrics {name: [runs, num_updates]}, each
        run's guarded state finite [runs]). The clock counts its training from its launch."""
        metrics, finite = jax.device_get((launched.metrics, launched.finite))
        self.clock.train_seconds += time.perf_counter() - launched.started
        check_chunk_metrics(
            {k: v[0] for k, v in metrics.items()}, self.length, self.plan.trainer.guarded_metrics
        )
        metrics = {
            k: np.asarray(v[0] if k.startswith("record_") else v[0, :, : launched.num_updates])
            for k, v in metrics.items()
        }
        return launched.state, metrics, np.asarray(finite[0])


# `_state_finite` checks the leaves of up to this many elements as one vector per dtype: a
# kernel for all of them instead of one each, and fewer kernels compile faster. A larger leaf
# is checked where it lies, so that the check never copies much.
CONCATENATED_CHECK_SIZE = 2**16


def _state_finite(guarded) -> jax.Array:
    """Whether every floating-point leaf of `guarded` is finite: a scalar boolean."""
    checks, small = [], {}
    for x in jax.tree.leaves(guarded):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            continue
        if x.size <= CONCATENATED_CHECK_SIZE:
            small.setdefault(x.dtype, []).append(x.ravel())
        else:
            checks.append(jnp.isfinite(x).all())
    checks += [jnp.isfinite(jnp.concatenate(leaves)).all() for leaves in small.values()]
    return jnp.all(jnp.stack(checks or [jnp.bool_(True)]))


@dataclasses.dataclass(frozen=True)
class Divergence:
    """Where the first run diverged: the first update of a guarded metric's non-finite
    stretch or, where only the guarded state is not finite, the chunk's last update."""

    metric: str  # a guarded metric, or "parameters"
    value: str  # the metric's value there: "nan", "inf" or "-inf"
    update: int
    run: int
    logged_until: int  # the diverged chunk's last update: metrics.csv holds its rows

    def described(self) -> str:
        if self.metric == "parameters":
            return f"the parameters are not finite after update {self.update}"
        return f"{self.metric} is {self.value} at update {self.update}"


def _divergence(
    plan: RunPlan, finite_state: np.ndarray, metrics: dict, first_update: int
) -> Divergence | None:
    """After each chunk, on the host: where the first run diverged, or None. A run has diverged
    when a floating-point leaf of its guarded state (parameters, optimiser state) is NaN or inf
    at the chunk's end (`finite_state` [runs], from the chunk's own program), or when a guarded
    metric (a loss) is NaN or inf from some update to the chunk's end after a finite value: a
    diverged run does not recover. A guarded metric that is NaN from the chunk's start while
    the state is finite has nothing to report yet (DQN's loss before learning starts)."""
    names = plan.trainer.guarded_metrics
    last_update = first_update + next(iter(metrics.values())).shape[1] - 1
    # (update, run, metric's order) sorts the first divergence first
    found = [
        (last_update, run, len(names), "parameters", "") for run in np.flatnonzero(~finite_state)
    ]
    for order, name in enumerate(names):
        for run, values in enumerate(metrics[name]):
            finite = np.flatnonzero(np.isfinite(values))
            start = finite[-1] + 1 if finite.size else 0
            if start < len(values) and (start > 0 or not finite_state[run]):
                found.append((first_update + int(start), run, order, name, str(values[start])))
    if not found:
        return None
    update, run, _, metric, value = min(found)
    return Divergence(metric, value, int(update), int(run), last_update)


# Automatic checkpoints (--checkpoint-every 0) keep their writing to about this share of the
# training time: a large state, such as replay buffers over many seeds, is saved every few chunks.
CHECKPOINT_SHARE = 0.05


class _Checkpoints:
    """Which chunk ends process 0 saves, and the saving. With --checkpoint-every N, every N-th
    chunk; with 0, a chunk once the training since the latest save has taken at least that
    save's seconds over CHECKPOINT_SHARE (so the first chunk always). The driver also saves
    where a run stops: its last chunk, a stop signal, `stop_when`, divergence (the last finite
    state). Which chunks are saved changes nothing that a run computes."""

    def __init__(self, plan: RunPlan, clock: _Clock, saved_update: int):
        self.plan, self.clock = plan, clock
        self.saved_update = saved_update  # the latest checkpoint's (or where training starts)
        self.chunks = 0  # chunks trained since that checkpoint
        self.trained_at_save = clock.train_seconds  # the clock's training seconds then
        self.write_seconds = 0.0  # how long that save took (0: none saved by this process)

    def after_chunk(self, state, update: int, now: bool) -> None:
        """After a chunk that ended at `update`: save if due, or `now`."""
        self.chunks += 1
        every = self.plan.config.checkpoint_every
        if every:
            due = self.chunks >= every
        else:
            trained = self.clock.train_seconds - self.trained_at_save
            due = self.write_seconds <= CHECKPOINT_SHARE * trained
        if due or now:
            self.save(state, update)

    def save(self, state, update: int) -> None:
        """Save `state` as the checkpoint of `update`, unless the latest one holds it."""
        if not self.plan.is_main or update == self.saved_update:
            return
        start = time.perf_counter()
        checkpoint.save(
            self.plan.checkpoint_dir,
            update,
            state,
            self.clock.totals(update),
            keep=self.plan.config.keep_checkpoints,
        )
        self.write_seconds = time.perf_counter() - start
        self.saved_update, self.chunks = update, 0
        self.trained_at_save = self.clock.train_seconds


def train_in_chunks(
    plan: RunPlan,
    run_chunk: _ChunkRunner,
    state,
    start_update: int,
    clock: _Clock,
    wandb_sink,
    after_first_chunk: Callable | None = None,
    stop_when: Callable | None = None,
):
    """Train to the last update, one compiled chunk at a time. After each chunk, and only there,
    process 0 appends to metrics.csv and wandb, writes records and saves a checkpoint when one
    is due (`_Checkpoints`); a stop signal takes effect there too (utils/interrupts.py), after
    a checkpoint of the state it stops at. The next chunk is launched before that writing, so
    that the devices train while the host writes; a chunk after which training stops (the
    last, a stop, `stop_when`, divergence) launches none. A chunk in which a run diverged
    (`_divergence`; off with --allow-nonfinite) is logged but not kept: training stops at the
    last finite state. `after_first_chunk(state)`, if given, is called once the first chunk
    has trained (to start the background compilations that wait for it); `stop_when` as in
    `run_training`. Returns (that state, the update it reached, the Divergence or None)."""
    trainer, is_main = plan.trainer, plan.is_main
    guarded = not plan.config.allow_nonfinite
    divergence = None
    metrics_csv = None
    checkpoints = _Checkpoints(plan, clock, start_update)
    progress = _Progress(
        plan.config.progress and is_main, trainer.num_updates, start_update, trainer.env_id, trainer
    )

    def chunk_after(update: int) -> int:
        return min(plan.chunk_len, trainer.num_updates - update)

    update = start_update
    launched = None  # the chunk from `update` on, when the previous one launched it
    try:
        while update < trainer.num_updates:
            if interrupts.stop_requested():  # asked for after the last chunk's checkpoint
                checkpoints.save(state, update)
            interrupts.check()
            num_updates = chunk_after(update)
            launched = launched or run_chunk.launch(state, num_updates)
            new_state, metrics, finite_state = run_chunk.collect(launched)
            launched = None
            if after_first_chunk is not None:
                after_first_chunk(new_state)
                after_first_chunk = None
            # the first run's records
            records = {k: metrics.pop(k)[0] for k in list(metrics) if k.startswith("record_")}
            first_update, end = update + 1, update + num_updates
            divergence = _divergence(plan, finite_state, metrics, first_update) if guarded else None
            preempted = plan.multi_process and _preempted(end)
            stopped = stop_when is not None and stop_when(end, metrics)
            last = end == trainer.num_updates or preempted or stopped
            if divergence is None:
                # the state before this chunk is dropped first: two states at once, not three
                state, update = new_state, end
                if not last and not interrupts.stop_requested():
                    launched = run_chunk.launch(state, chunk_after(update))
            with interrupts.held():  # a chunk's logs, and its checkpoint if any, land together
                if is_main:
                    if metrics_csv is None:
                        metrics_csv = MetricsCsv(
                            plan.csv_path,
                            plan.run_columns,
                            sorted(metrics),
                            keep_until_update=start_update if plan.config.resume else None,
                        )
                    metrics_csv.append(first_update, trainer.steps_per_update, metrics)
                    if wandb_sink is not None:
                        wandb_sink.log(first_update, trainer.steps_per_update, metrics)
                if divergence is not None:
                    # its rows show the NaN; its state is not kept, the state before it is saved
                    checkpoints.save(state, update)
                    break
                checkpoints.after_chunk(state, update, now=last or interrupts.stop_requested())
            if is_main and records and trainer.write_records is not None:
                with naming_the_file(os.path.join(plan.run_dir, "games")):
                    written = trainer.write_records(plan.run_dir, update, records)
                if wandb_sink is not None:
                    wandb_sink.log_files(update * trainer.steps_per_update, written)
            clock.chunk_ends.append(clock.totals(update))
            done_steps = (update - start_update) * trainer.steps_per_update * plan.num_runs
            last_values = metrics[trainer.headline_metric][:, -1]
            mean_value = np.nanmean(last_values) if np.isfinite(last_values).any() else np.nan
            progress.update(update, mean_value, done_steps / max(clock.train_seconds, 1e-9))
            if preempted:
                raise KeyboardInterrupt  # as a stop signal would: every process stops here
            if stopped:
                break
    finally:
        progress.close()
    return state, update, divergence


def _preempted(update: int) -> bool:
    """In a process group: whether JAX's preemption notifier (SIGTERM to any of the processes,
    utils/interrupts.py leaves it to JAX there) has every process stop after this update."""
    if not jax.config.jax_enable_preemption_service:
        return False
    return multihost_utils.reached_preemption_sync_point(update)


def _interrupted(plan: RunPlan) -> str:
    """The line a stopped run ends with. With a checkpoint, how to resume; a new run stopped
    before its first checkpoint leaves no directory behind."""
    update = checkpoint.latest_update(plan.checkpoint_dir) if plan.is_main else None
    if not plan.is_main or plan.multi_process:
        return f"interrupted after update {update}" if update else "interrupted"
    if os.path.exists(os.path.join(plan.run_dir, "summary.json")):
        return f"interrupted after the run finished -> {plan.run_dir}"
    if update is not None:
        return f"interrupted after update {update}; continue with --resume {plan.run_dir}"
    if plan.config.resume is None:
        return _remove_new_run(plan.run_dir)
    return "interrupted before the first checkpoint"


def _remove_new_run(run_dir: str) -> str:
    """A new run stopped before its first checkpoint leaves no directory behind."""
    shutil.rmtree(run_dir, ignore_errors=True)
    return f"interrupted before the first checkpoint; removed {run_dir}"


def _exit_interrupted(plan: RunPlan) -> None:
    """After Ctrl-C or SIGTERM: one line and exit code 130."""
    interrupts.exit_interrupted(functools.partial(_interrupted, plan))


class _FinalEvaluation:
    """The trainer's evaluation after training (Trainer.evaluate), vmapped over the runs of the
    first device's state. Its program runs once, so it compiles at LLVM level 0
    (`compile_for_one_call`); `start_compiling` has it compile in a background thread while
    the chunks after the first train, on the core that training on one device leaves idle."""

    def __init__(self, plan: RunPlan, clock: _Clock):
        self.plan, self.clock, self.compiled = plan, clock, None
        self.on_first_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def _lowered(self, first_device_state):
        """The program (first device's state, run keys [runs, 2]) -> episode returns [runs,
        episodes]. Each run's evaluation key, its run key folded with 1, is derived inside it,
        so that no program of its own compiles beside the first chunk's."""

        def evaluate(state, run_key):
            return self.plan.trainer.evaluate(state, jax.random.fold_in(run_key, 1))

        return jax.jit(jax.vmap(evaluate)).lower(first_device_state, self.plan.run_keys)

    def start_compiling(self, state) -> None:
        """Begin compiling from the shapes of `state`, leaves [local devices, runs, ...]; a
        run of several processes compiles when it evaluates instead."""
        if self.plan.trainer.evaluate is None or self.plan.multi_process or self.compiled:
            return
        shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape[1:], x.dtype, sharding=self.on_first_device, weak_type=x.weak_type
            ),
            state,
        )
        self.compiled = _in_background(lambda: compile_for_one_call(self._lowered(shapes)))

    def __call__(self, state) -> np.ndarray | None:
        """Episode returns [runs, episodes], or None without an evaluation."""
        if self.plan.trainer.evaluate is None:
            return None
        first_device_state = jax.tree.map(lambda x: x[0], state)
        if self.compiled is not None:  # x[0] of a leaf replicated over devices spans them all
            first_device_state = jax.device_put(first_device_state, self.on_first_device)
        start = time.perf_counter()
        if self.compiled is None:
            evaluate = compile_for_one_call(self._lowered(first_device_state))
        else:
            evaluate = self.compiled.result()
        self.clock.compile_seconds += time.perf_counter() - start
        return np.asarray(evaluate(first_device_state, self.plan.run_keys))


def _evaluation_fields(evaluation: np.ndarray | None, num_runs: int) -> dict:
    """summary.json's evaluation after training, from the episode returns [runs, episodes]
    (None: no evaluation, null returns)."""
    eval_returns = [float("nan")] * num_runs if evaluation is None else evaluation.mean(1).tolist()
    return {
        "eval_episodes": 0 if evaluation is None else evaluation.shape[1],
        "eval_return_per_seed": eval_returns,
        "eval_return_mean": float(np.mean(eval_returns)),
        "eval_return_std": float(np.std(eval_returns)),
    }


def _capture_video(plan: RunPlan, state, wandb_sink) -> None:
    """--capture-video: one greedy episode of the first run, as RUN_DIR/videos/final.gif."""
    trainer = plan.trainer
    gif_path = os.path.join(plan.run_dir, "videos", "final.gif")
    with naming_the_file(gif_path):
        video_path = write_episode_gif(
            trainer.env_id,
            trainer.video_policy(jax.tree.map(lambda x: x[0, 0], state)),  # device 0, run 0
            jax.random.fold_in(plan.run_keys[0], 2),
            gif_path,
        )
    if video_path is not None and wandb_sink is not None:
        wandb_sink.log_video(video_path)


def _summary(
    plan: RunPlan, columns: dict, evaluation, updates: tuple[int, int], clock, divergence=None
) -> dict:
    """summary.json: lists "per seed" hold one entry per run, configuration-major when
    sweeping. "final_*" is the headline metric over the last updates trained; "eval_return_*"
    the mean return of the evaluation after training (null without one); "chunk_ends" the
    update and the run's seconds so far (wall, compile, train) at the end of every chunk this
    process trained, its logs and checkpoint written (after a resume: from there on);
    "diverged" where the first run diverged (null if none did); "stopped_at_update" the update
    at which `run_training`'s `stop_when` ended the training (null if it did not)."""
    trainer, config = plan.trainer, plan.config
    start_update, trained_until = updates
    end_update = trained_until if divergence is None else divergence.logged_until
    num_seeds, num_runs = config.num_seeds, plan.num_runs
    evaluation_fields = _evaluation_fields(evaluation, num_runs)
    final_values = _final_values(columns, trainer.headline_metric, num_seeds, num_runs, end_update)
    metric_names = [n for n in columns if n not in ("update", "env_steps", *plan.run_columns)]
    totals = clock.totals(end_update)
    steps_done = (end_update - start_update) * trainer.steps_per_update * num_runs
    steps_per_second = steps_done / max(clock.train_seconds, 1e-9)
    final_mean, final_std = _mean_and_std(final_values)
    summary = {
        "algo": trainer.algo,
        "env_id": trainer.env_id,
        "run_dir": plan.run_dir,
        "seeds": [config.seed + int(i) for i in plan.run_seed],
        "num_devices": trainer.runtime.num_devices,
        "num_processes": jax.process_count(),
        "num_updates": trainer.num_updates,
        "env_steps_per_seed": trainer.num_updates * trainer.steps_per_update,
        "headline_metric": trainer.headline_metric,
        "final_per_seed": final_values,
        "final_mean": final_mean,
        "final_std": final_std,
        **evaluation_fields,
        "final_metrics_per_seed": _last_reported(columns, metric_names, num_seeds, num_runs),
        "step_unit": trainer.step_unit,
        "steps_per_second": steps_per_second,
        "steps_per_second_per_seed": steps_per_second / num_runs,
        "compile_seconds": totals["compile_seconds"],
        "train_seconds": totals["train_seconds"],
        "wall_seconds": totals["wall_seconds"],
        "resumed_from_update": start_update if config.resume is not None else None,
        "chunk_ends": clock.chunk_ends,
        "diverged": None if divergence is None else _divergence_entry(plan, divergence),
        "stopped_at_update": (
            trained_until if divergence is None and trained_until < trainer.num_updates else None
        ),
    }
    if config.sweep:
        summary["sweep"] = {
            "parameters": list(plan.overrides[0]),
            "num_configs": len(plan.overrides),
            "ranking": _sweep_ranking(
                plan.overrides, final_values, evaluation_fields["eval_return_per_seed"]
            ),
        }
    return summary


def _divergence_entry(plan: RunPlan, divergence: Divergence) -> dict:
    """summary.json's "diverged": the metric, the update and the run (its seed, and its
    configuration when sweeping)."""
    entry = {
        "metric": divergence.metric,
        "update": divergence.update,
        "seed": plan.config.seed + int(plan.run_seed[divergence.run]),
    }
    if plan.config.sweep:
        entry["config"] = int(plan.run_config[divergence.run])
    return entry


def _divergence_line(plan: RunPlan, divergence: Divergence) -> str:
    """The one line a diverged run prints: what, where, and the checkpoint it kept."""
    of_run = ""
    if plan.num_runs > 1:
        entry = _divergence_entry(plan, divergence)
        swept = f", {config_label(plan.overrides[entry['config']])}" if "config" in entry else ""
        of_run = f" (seed {entry['seed']}{swept})"
    kept = checkpoint.latest_update(plan.checkpoint_dir)
    keeps = "no checkpoint before it" if kept is None else f"kept the checkpoint of update {kept}"
    return f"diverged: {divergence.described()}{of_run}; {keeps} -> {plan.run_dir}"


def _result_line(plan: RunPlan, summary: dict) -> str:
    """The one line a finished run prints."""
    trainer, config = plan.trainer, plan.config
    evaluated = trainer.evaluate is not None
    headline = "return" if trainer.headline_metric == "episode_return" else trainer.headline_metric
    best = summary
    result = f"final {headline} {best['final_mean']:.3g} ± {best['final_std']:.2g}"
    if config.sweep:
        best = summary["sweep"]["ranking"][0]
        result = (
            f"best of {len(plan.overrides)} configs {config_label(best['hyperparams'])}: final "
            f"{headline} {best['final_mean']:.3g} ± {best['final_std']:.2g}"
        )
    evaluation = f"eval {best['eval_return_mean']:.1f}, " if evaluated else ""
    if summary["stopped_at_update"] is not None:
        result = (
            f"stopped at update {summary['stopped_at_update']} of {trainer.num_updates}, {result}"
        )
    return (
        f"{trainer.algo} {trainer.env_id}: {result} over {config.num_seeds} seed(s), "
        f"{evaluation}{summary['steps_per_second']:,.0f} {trainer.step_unit}/s, "
        f"compile {summary['compile_seconds']:.1f} s, wall {summary['wall_seconds']:.1f} s "
        f"-> {plan.run_dir}"
    )


def report(
    plan: RunPlan,
    state,
    updates: tuple[int, int],
    clock: _Clock,
    wandb_sink,
    evaluate_final: _FinalEvaluation,
    divergence=None,
) -> dict:
    """Process 0 after training from update `updates[0]` to `updates[1]`: evaluation
    (`evaluate_final`), video, the learning curve, summary.json, wandb's summary and the
    one-line result. A diverged run gets neither evaluation nor video, and its line on stderr
    says where it diverged."""
    diverged = divergence is not None
    eval_returns = None if diverged else evaluate_final(state)
    if plan.trainer.video_policy is not None and not diverged:
        _capture_video(plan, state, wandb_sink)
    columns = read_metrics_csv(plan.csv_path)
    summary = _summary(plan, columns, eval_returns, updates, clock, divergence)
    trainer = plan.trainer
    png_path = os.path.join(plan.run_dir, "learning_curve.png")
    with naming_the_file(png_path):
        plot_learning_curve(
            columns,
            png_path,
            f"{trainer.algo} {trainer.env_id}",
            trainer.headline_metric,
            trainer.step_unit,
            [config_label(values) for values in plan.overrides] if plan.config.sweep else None,
        )
    # last: a run directory with a summary has every output, and --resume finds it complete
    write_json(os.path.join(plan.run_dir, "summary.json"), summary)
    if wandb_sink is not None:
        wandb_sink.finish(summary)
    if diverged:
        print(_divergence_line(plan, divergence), file=sys.stderr)
    else:
        print(_result_line(plan, summary))
    return summary


def reevaluate(plan: RunPlan, summary: dict) -> dict:
    """--resume of a finished run with an evaluation size on the command line: the final
    evaluation again, of the last checkpoint's state, with that size and the same keys. Only
    summary.json's evaluation fields change (eval_*, and the sweep ranking's); every training
    figure (final_*, steps/s, seconds) stays as the training wrote it."""
    clock = _Clock(wall_start=time.perf_counter())  # apart: the training's seconds stay
    state, _ = start_or_resume(plan, clock)
    if plan.trainer.evaluate is not None:
        fields = _evaluation_fields(_FinalEvaluation(plan, clock)(state), plan.num_runs)
    else:
        fields = _chunk_evaluation_fields(plan, state)
    summary = {**summary, **fields}
    for entry in summary.get("sweep", {}).get("ranking", []):
        num_seeds = plan.config.num_seeds
        of_config = slice(entry["config"] * num_seeds, (entry["config"] + 1) * num_seeds)
        for name in ("eval_return_per_seed", "eval_metrics_per_seed"):
            if name in fields:
                entry[name] = fields[name][of_config]
        if "eval_return_per_seed" in fields:
            entry["eval_return_mean"] = float(np.mean(entry["eval_return_per_seed"]))
    write_json(os.path.join(plan.run_dir, "summary.json"), summary)
    print(_reevaluation_line(plan, summary))
    return summary


def _eval_size_field(config) -> str:
    """The config's field that sizes the final evaluation: eval_episodes or eval_games."""
    return next(name for name in EVAL_SIZE_FIELDS if hasattr(config, name))


def _chunk_evaluation_fields(plan: RunPlan, state) -> dict:
    """The evaluation that ends every chunk (Trainer.chunk_evaluation) of the final state:
    the evaluation size and "eval_metrics_per_seed", one {name: value} per run."""
    trainer = plan.trainer
    evaluate = jax.pmap(_over_runs(trainer.chunk_evaluation, plan.num_runs), axis_name=DEVICE_AXIS)
    metrics = jax.device_get(evaluate(state))
    per_run = [
        {name: float(v[0, run]) for name, v in metrics.items() if not name.startswith("record_")}
        for run in range(plan.num_runs)
    ]
    size = _eval_size_field(plan.config)
    return {size: getattr(plan.config, size), "eval_metrics_per_seed": per_run}


def _reevaluation_line(plan: RunPlan, summary: dict) -> str:
    """The one line of a re-evaluation: its size and its mean over the runs (the return, or
    the headline metric of a chunk evaluation)."""
    trainer, size = plan.trainer, _eval_size_field(plan.config)
    if trainer.evaluate is not None:
        name, values = "return", summary["eval_return_per_seed"]
    else:
        metrics = summary["eval_metrics_per_seed"]
        name = trainer.headline_metric if trainer.headline_metric in metrics[0] else min(metrics[0])
        values = [m[name] for m in metrics]
    values = np.array(values, float)  # null (no value) as NaN
    return (
        f"{trainer.algo} {trainer.env_id}: re-evaluated update {trainer.num_updates} with "
        f"--{size.replace('_', '-')} {getattr(plan.config, size)}: eval {name} "
        f"{np.mean(values):.3g} ± {np.std(values):.2g} over {len(values)} run(s) -> {plan.run_dir}"
    )


@interrupts.stop_at_safe_points()
def run_training(
    config,
    make_train: Callable,
    validate: Callable,
    return_state: bool = False,
    *,
    stop_when: Callable[[int, dict], bool] | None = None,
):
    """Plan, start or resume, train in chunks and report (utils/trainer.py has the contract
    `make_train` and `validate` follow). Returns the summary dict (None on the processes other
    than 0 of a multi-process run), and with `return_state` also this process's final training
    state, leaves [local devices, runs, ...]. A run that diverged exits with DIVERGED_EXIT_CODE
    once it has reported. --resume of a finished run trains nothing: it says so, or, asked
    with an evaluation size (`config.reevaluate`), evaluates the final state again.

    `stop_when(update, metrics)`, for a program that drives runs (a benchmark, a search), is
    called after each chunk, before its logs and checkpoint are written, with the update
    reached and the chunk's metrics {name: [runs, updates of the chunk]}; True ends the
    training there, once that chunk's logs and checkpoint are written, and the run reports as
    at its last update (summary.json's "stopped_at_update"). A later --resume trains on from
    that checkpoint. Single-process runs only."""
    clock = _Clock(wall_start=time.perf_counter())
    if stop_when is not None and jax.process_count() > 1:
        raise ValueError("stop_when needs a single-process run: every process would have to stop")
    plan = plan_runs(config, make_train, validate)
    interrupts.exit_says(functools.partial(_interrupted, plan))
    finished = plan.resume_update == plan.trainer.num_updates
    if finished and os.path.exists(os.path.join(plan.run_dir, "summary.json")):
        summary = read_json(os.path.join(plan.run_dir, "summary.json"), "--resume")
        if config.reevaluate and (plan.trainer.evaluate or plan.trainer.chunk_evaluation):
            with _run_lock(plan.run_dir):
                summary = reevaluate(plan, summary)
        else:
            print(f"{plan.trainer.algo} {plan.trainer.env_id}: already complete -> {plan.run_dir}")
        return (summary, None) if return_state else summary
    with _run_lock(plan.run_dir):
        try:
            interrupts.check()  # a stop asked for while planning
            run_chunk = _ChunkRunner(plan, clock, first_update=plan.resume_update or 0)
            state, start_update = start_or_resume(plan, clock, run_chunk.start_compiling)
            wandb_sink = _wandb_sink(plan)
            evaluate_final = _FinalEvaluation(plan, clock)

            def after_first_chunk(state):
                if plan.is_main:
                    evaluate_final.start_compiling(state)

            state, end_update, divergence = train_in_chunks(
                plan,
                run_chunk,
                state,
                start_update,
                clock,
                wandb_sink,
                after_first_chunk=after_first_chunk,
                stop_when=stop_when,
            )
            interrupts.check()
            if plan.is_main:
                summary = report(
                    plan,
                    state,
                    (start_update, end_update),
                    clock,
                    wandb_sink,
                    evaluate_final,
                    divergence,
                )
            else:
                summary = None
        except KeyboardInterrupt:
            _exit_interrupted(plan)
    if not plan.is_main:
        print(
            f"{plan.trainer.algo} {plan.trainer.env_id}: process {jax.process_index()} of "
            f"{jax.process_count()} done; process 0 writes the run directory"
        )
    if plan.multi_process:
        # no process leaves the group while process 0 still evaluates and reports
        multihost_utils.sync_global_devices(_REPORTED_BARRIER)
    if divergence is not None:
        sys.exit(DIVERGED_EXIT_CODE)
    return (summary, state) if return_state else summary


def _wandb_sink(plan: RunPlan) -> WandbSink | None:
    """With --track, process 0's wandb run: one curve per run of the headline metric."""
    if not (plan.config.track and plan.is_main):
        return None
    run_name = os.path.basename(os.path.normpath(plan.run_dir))
    run_labels = [
        f"{config_label(plan.overrides[k])} seed_{i}".strip()
        for k, i in zip(plan.run_config, plan.run_seed, strict=True)
    ]
    trainer = plan.trainer
    return WandbSink(
        plan.config,
        plan.run_dir,
        run_name,
        trainer.headline_metric,
        run_labels,
        trainer.num_updates,
    )
