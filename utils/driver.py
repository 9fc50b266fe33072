"""The training driver every trainer shares: compiled chunks, logs, checkpoints, summary.

A trainer script builds a `Trainer` (pure functions) and hands it to `run_training`. The
driver runs `train_chunk` (a `lax.scan` over updates) under `pmap(vmap(...))`: devices on
the outer axis, seeds on the inner one. Between chunks, and only there, it touches the host:
metrics.csv, wandb, the progress bar and an atomic checkpoint. With a single chunk the whole
run is exactly one scan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from utils import checkpoint
from utils.devices import (
    DEVICE_AXIS,
    process_group,
    resolve_num_devices,
    split_cpu_host,
    unroll_threefry_on_cpu,
)
from utils.errors import ConfigError
from utils.logs import MetricsCsv, WandbSink, read_metrics_csv, write_json
from utils.plotting import plot_learning_curve
from utils.sweep import config_label, sweep_configs
from utils.video import write_episode_gif

CHUNKS_PER_RUN = 25  # automatic chunking aims at about this many progress/checkpoint points
# every process of a multi-process run meets here once process 0 has written its report
_REPORTED_BARRIER = "purejaxrl run reported"


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What `make_train(config)` returns. Every function is pure and runs under the driver's
    `pmap(vmap(f), axis_name=DEVICE_AXIS)`, so it sees one seed on one device. Metrics must
    already be reduced over DEVICE_AXIS (psum/pmean): the driver logs device 0's copy, and it
    reads `metrics[headline_metric]` for the progress bar and the summary. NaN in a metric
    means "nothing to report at this update" (no episode ended, no evaluation ran)."""

    algo: str
    env_id: str
    num_updates: int
    steps_per_update: int  # env steps (or moves) of one seed per update, all devices together
    # the trainer's HyperParams from the config: the values that change no array shape, which
    # init puts into the state, so that --sweep can vary them inside one program
    hyperparams: tuple
    init: Callable  # (key, hyperparams) -> state
    train_chunk: Callable  # (state, num_updates) -> (state, {metric: [num_updates]})
    # (state, key) -> episode returns [eval_episodes], called unpmapped after training; None when
    # the trainer evaluates inside its chunks instead.
    evaluate: Callable | None
    # (state) -> (obs batch -> action batch), the greedy policy that --capture-video films
    greedy_policy: Callable | None = None
    # (run_dir, update, records) -> written files: with --capture-video, chunk outputs named
    # "record_*" are taken out of the metrics and handed to this host function
    write_records: Callable | None = None
    headline_metric: str = "episode_return"  # the progress bar's number and the final return
    step_unit: str = "steps"  # what steps_per_update counts, for the reports
    updates_per_chunk: int | None = None  # a chunk length the algorithm needs (None: free)
    # lower jax.random's threefry hash unrolled on CPU (utils/devices.py): faster where small
    # updates draw random numbers often, slower for AlphaZero's self-play (docs/benchmarks.md)
    unrolled_threefry: bool = True

    def train(self, key):
        """The whole run as one scan over updates: (final state, metrics [num_updates])."""
        return self.train_chunk(self.init(key, self.hyperparams), self.num_updates)


def auto_updates_per_chunk(num_updates: int) -> int:
    """A chunk length near num_updates / CHUNKS_PER_RUN that divides num_updates if one is
    close, so that every chunk has the same length and compiles once."""
    target = max(1, round(num_updates / CHUNKS_PER_RUN))
    divisors = [d for d in range(max(1, target // 2), 2 * target + 1) if num_updates % d == 0]
    return min(divisors, key=lambda d: abs(d - target)) if divisors else target


def _over_runs(f: Callable, num_runs: int) -> Callable:
    """`jax.vmap(f)` over the leading run axis (seeds x sweep configurations). A single run
    goes unbatched and gets its axis back: a size-1 vmap still batches every gather and
    scatter (mctx's tree updates, for one), which slows AlphaZero's self-play on CPU
    (docs/benchmarks.md)."""
    if num_runs > 1:
        return jax.vmap(f)

    def single_run(*args):
        out = f(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return single_run


def check_run_config(config) -> None:
    if config.num_seeds < 1:
        raise ConfigError(f"--num-seeds must be >= 1, got {config.num_seeds}")
    if config.updates_per_chunk < 0:
        raise ConfigError(f"--updates-per-chunk must be >= 0, got {config.updates_per_chunk}")
    if config.eval_episodes < 0:
        raise ConfigError(f"--eval-episodes must be >= 0, got {config.eval_episodes}")


def _new_run_dir(config, trainer: Trainer) -> str:
    name = f"{trainer.env_id}__{trainer.algo}__{config.seed}__{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = os.path.join(config.runs_dir, name)
    suffix = 1
    while os.path.exists(run_dir):
        suffix += 1
        run_dir = os.path.join(config.runs_dir, f"{name}-{suffix}")
    os.makedirs(run_dir)
    write_json(os.path.join(run_dir, "config.json"), dataclasses.asdict(config))
    return run_dir


class _Progress:
    """A rich progress bar: updates done, latest mean return, steps/s and ETA."""

    def __init__(self, enabled: bool, total: int, done: int, label: str, trainer: Trainer):
        self.bar = None
        if not enabled:
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
        if self.bar is not None:
            ret = "-" if math.isnan(mean_return) else f"{mean_return:.3g}"
            self.bar.update(self.task, completed=done, ret=ret, sps=f"{steps_per_second:,.0f}")

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
    """Per run: the last finite value of every metric (NaN if it never reported one)."""
    row_run = _run_of_rows(columns, num_seeds)
    last = []
    for run in range(num_runs):
        finite = {
            name: columns[name][(row_run == run) & np.isfinite(columns[name])]
            for name in metric_names
        }
        last.append({name: float(v[-1]) if v.size else float("nan") for name, v in finite.items()})
    return last


def _sweep_ranking(overrides: list[dict], finals: list[float], evals: list[float]) -> list[dict]:
    """One entry per configuration, best mean final value first (NaN last), with the spread
    over its seeds."""
    num_seeds = len(finals) // len(overrides)
    ranking = []
    for k, values in enumerate(overrides):
        of_config = slice(k * num_seeds, (k + 1) * num_seeds)
        config_finals, config_evals = finals[of_config], evals[of_config]
        ranking.append(
            {
                "config": k,
                "hyperparams": values,
                "final_return_mean": float(np.nanmean(config_finals)),
                "final_return_std": float(np.nanstd(config_finals)),
                "final_return_per_seed": config_finals,
                "eval_return_mean": float(np.mean(config_evals)),
                "eval_return_per_seed": config_evals,
            }
        )
    return sorted(
        ranking,
        key=lambda r: -r["final_return_mean"] if np.isfinite(r["final_return_mean"]) else np.inf,
    )


def run_training(config, make_train: Callable[..., Trainer], return_state: bool = False):
    """Validate, build, train in chunks, evaluate and report. Returns the summary dict (None on
    the processes other than 0 of a multi-process run), and with `return_state` also this
    process's final training state, leaves [local devices, runs, ...]."""
    wall_start = time.perf_counter()
    check_run_config(config)
    # may restart the process, so before anything is written
    split_cpu_host(config.cpu_devices, process_group(config))
    multi_process, is_main = jax.process_count() > 1, jax.process_index() == 0
    if multi_process and config.resume is not None:
        raise ConfigError(
            "--resume of a multi-process run is not supported: its checkpoint holds process "
            "0's environments only"
        )
    config = dataclasses.replace(config, num_devices=resolve_num_devices(config.num_devices))
    trainer = make_train(config)  # raises ConfigError for bad algorithm flags, before compiling
    unroll_threefry_on_cpu(trainer.unrolled_threefry)  # before anything is lowered
    num_devices, num_seeds = config.num_devices, config.num_seeds
    local_devices = num_devices // jax.process_count()  # the pmapped axis of this process

    # The runs side by side: sweep configurations x seeds, configuration-major. Each
    # configuration goes through make_train too, so its values get the trainer's own checks.
    overrides = sweep_configs(config, trainer.hyperparams._fields)
    config_hyperparams = [
        make_train(dataclasses.replace(config, **values)).hyperparams
        if values
        else trainer.hyperparams
        for values in overrides
    ]
    num_configs = len(overrides)
    num_runs = num_configs * num_seeds
    run_seed = np.tile(np.arange(num_seeds), num_configs)  # seed index of each run
    run_config = np.repeat(np.arange(num_configs), num_seeds)
    run_columns = {"seed": run_seed.tolist()}
    if config.sweep:
        run_columns["config"] = run_config.tolist()
        for name in overrides[0]:
            run_columns[name] = [overrides[k][name] for k in run_config]

    # Only process 0 writes: the run directory, logs, checkpoints and the summary.
    resuming = config.resume is not None
    run_dir = config.resume if resuming else _new_run_dir(config, trainer) if is_main else None
    checkpoint_dir = os.path.join(run_dir, "checkpoints") if is_main else None
    csv_path = os.path.join(run_dir, "metrics.csv") if is_main else None

    # Initialise on the devices: every device gets the seed's key, so network parameters are
    # identical across devices; trainers fold the device index into their environment keys.
    # Configuration k with seed index i starts exactly as a single run with seed + i would.
    run_keys = np.stack([np.asarray(jax.random.PRNGKey(config.seed + i)) for i in run_seed])
    run_hyperparams = jax.tree.map(
        lambda *values: np.stack(values)[run_config], *config_hyperparams
    )
    on_every_device = functools.partial(
        jax.tree.map, lambda x: np.repeat(x[None], local_devices, 0)
    )
    compile_start = time.perf_counter()
    # Runs are initialised one after another (lax.map), not vmapped: a batched LAPACK QR, as
    # in orthogonal weight init, can deadlock XLA:CPU's thread pool on small machines.
    init_runs = jax.pmap(
        lambda keys, hyperparams: jax.lax.map(lambda run: trainer.init(*run), (keys, hyperparams)),
        axis_name=DEVICE_AXIS,
    )
    state = jax.block_until_ready(init_runs(*on_every_device((run_keys, run_hyperparams))))
    compile_seconds = time.perf_counter() - compile_start
    start_update, meta = 0, {"train_seconds": 0.0, "compile_seconds": 0.0, "wall_seconds": 0.0}
    if resuming:
        host_state, meta = checkpoint.restore(checkpoint_dir, state)
        state = jax.tree.map(lambda h, t: jax.device_put(h, t.sharding), host_state, state)
        start_update = int(meta.pop("update"))
    previous = {k: meta[k] for k in ("train_seconds", "compile_seconds", "wall_seconds")}

    chunk_len = (
        trainer.updates_per_chunk
        or config.updates_per_chunk
        or auto_updates_per_chunk(trainer.num_updates)
    )
    compiled_chunks: dict[int, Callable] = {}

    def compiled_chunk(num_updates: int):
        nonlocal compile_seconds
        if num_updates not in compiled_chunks:
            chunk = functools.partial(trainer.train_chunk, num_updates=num_updates)
            start = time.perf_counter()
            pmapped = jax.pmap(_over_runs(chunk, num_runs), axis_name=DEVICE_AXIS)
            compiled = pmapped.lower(state).compile()
            compile_seconds += time.perf_counter() - start
            # A compiled pmap takes global arrays only; with several processes the pmapped
            # function converts this process's arrays and reuses the compilation.
            compiled_chunks[num_updates] = pmapped if multi_process else compiled
        return compiled_chunks[num_updates]

    metrics_csv = None
    run_labels = [
        f"{config_label(overrides[k])} seed_{i}".strip()
        for k, i in zip(run_config, run_seed, strict=True)
    ]
    wandb_sink = (
        WandbSink(
            config,
            run_dir,
            os.path.basename(os.path.normpath(run_dir)),
            trainer.headline_metric,
            run_labels,
        )
        if config.track and is_main
        else None
    )
    progress = _Progress(
        config.progress and is_main, trainer.num_updates, start_update, trainer.env_id, trainer
    )
    steps_per_update = trainer.steps_per_update
    update, train_seconds, saved_update = start_update, 0.0, start_update

    def meta_now() -> dict:
        return {
            "update": update,
            "train_seconds": previous["train_seconds"] + train_seconds,
            "compile_seconds": previous["compile_seconds"] + compile_seconds,
            "wall_seconds": previous["wall_seconds"] + time.perf_counter() - wall_start,
        }

    try:
        while update < trainer.num_updates:
            num_updates = min(chunk_len, trainer.num_updates - update)
            run_chunk = compiled_chunk(num_updates)
            start = time.perf_counter()
            new_state, metrics = run_chunk(state)
            metrics = {k: np.asarray(v[0]) for k, v in jax.device_get(metrics).items()}
            train_seconds += time.perf_counter() - start
            # the first run's records
            records = {k: metrics.pop(k)[0] for k in list(metrics) if k.startswith("record_")}
            with checkpoint.defer_sigint():  # logs and checkpoint of a chunk land together
                state, first_update = new_state, update + 1
                update += num_updates
                if is_main:
                    if metrics_csv is None:
                        keep = start_update if resuming else None
                        metrics_csv = MetricsCsv(
                            csv_path, run_columns, sorted(metrics), keep_until_update=keep
                        )
                    metrics_csv.append(first_update, steps_per_update, metrics)
                    if wandb_sink is not None:
                        wandb_sink.log(first_update, steps_per_update, metrics)
                    checkpoint.save(checkpoint_dir, update, state, meta_now())
                    saved_update = update
            if is_main and records and trainer.write_records is not None:
                written = trainer.write_records(run_dir, update, records)
                if wandb_sink is not None:
                    wandb_sink.log_files(update * steps_per_update, written)
            done_steps = (update - start_update) * steps_per_update * num_runs
            last_returns = metrics[trainer.headline_metric][:, -1]
            mean_return = np.nanmean(last_returns) if np.isfinite(last_returns).any() else np.nan
            progress.update(update, mean_return, done_steps / max(train_seconds, 1e-9))
    except KeyboardInterrupt:
        progress.close()
        if is_main and saved_update != update:
            checkpoint.save(checkpoint_dir, update, state, meta_now())
        resume_hint = f"; continue with --resume {run_dir}" if is_main and not multi_process else ""
        print(f"\ninterrupted after update {update}{resume_hint}", file=sys.stderr)
        sys.exit(130)
    progress.close()
    if not is_main:
        # Wait for process 0's evaluation and reports, so that no process leaves the group
        # while another still works.
        multihost_utils.sync_global_devices(_REPORTED_BARRIER)
        print(
            f"{trainer.algo} {trainer.env_id}: process {jax.process_index()} of "
            f"{jax.process_count()} done, {update} updates; process 0 wrote the run directory"
        )
        return (None, state) if return_state else None

    eval_returns = [float("nan")] * num_runs
    if config.eval_episodes > 0 and trainer.evaluate is not None:
        first_device_state = jax.tree.map(lambda x: x[0], state)
        eval_keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(run_keys)
        start = time.perf_counter()
        evaluate = (
            jax.jit(jax.vmap(trainer.evaluate)).lower(first_device_state, eval_keys).compile()
        )
        compile_seconds += time.perf_counter() - start
        eval_returns = np.asarray(evaluate(first_device_state, eval_keys)).mean(axis=1).tolist()

    columns = read_metrics_csv(csv_path)
    video_path = None
    if config.capture_video:
        if trainer.greedy_policy is None:
            print(f"--capture-video: {trainer.algo} records no episode video")
        else:
            first_run = jax.tree.map(lambda x: x[0, 0], state)  # device 0, run 0
            video_path = write_episode_gif(
                trainer.env_id,
                trainer.greedy_policy(first_run),
                jax.random.fold_in(run_keys[0], 2),
                os.path.join(run_dir, "videos", "final.gif"),
            )
        if video_path is not None and wandb_sink is not None:
            wandb_sink.log_video(video_path)

    final_returns = _final_values(
        columns, trainer.headline_metric, num_seeds, num_runs, trainer.num_updates
    )
    metric_names = [n for n in columns if n not in ("update", "env_steps", *run_columns)]
    totals = meta_now()
    steps_done = (trainer.num_updates - start_update) * steps_per_update * num_runs
    steps_per_second = steps_done / max(train_seconds, 1e-9)
    # Lists "per seed" hold one entry per run: configuration-major when sweeping.
    summary = {
        "algo": trainer.algo,
        "env_id": trainer.env_id,
        "run_dir": run_dir,
        "seeds": [config.seed + int(i) for i in run_seed],
        "num_devices": num_devices,
        "num_processes": jax.process_count(),
        "num_updates": trainer.num_updates,
        "env_steps_per_seed": trainer.num_updates * steps_per_update,
        "headline_metric": trainer.headline_metric,
        "final_return_per_seed": final_returns,
        "final_return_mean": float(np.nanmean(final_returns)),
        "final_return_std": float(np.nanstd(final_returns)),
        "eval_episodes": config.eval_episodes,
        "eval_return_per_seed": eval_returns,
        "eval_return_mean": float(np.mean(eval_returns)),
        "eval_return_std": float(np.std(eval_returns)),
        "final_metrics_per_seed": _last_reported(columns, metric_names, num_seeds, num_runs),
        "step_unit": trainer.step_unit,
        "steps_per_second": steps_per_second,
        "steps_per_second_per_seed": steps_per_second / num_runs,
        "compile_seconds": totals["compile_seconds"],
        "train_seconds": totals["train_seconds"],
        "wall_seconds": totals["wall_seconds"],
        "resumed_from_update": start_update if resuming else None,
    }
    if config.sweep:
        summary["sweep"] = {
            "parameters": list(overrides[0]),
            "num_configs": num_configs,
            "ranking": _sweep_ranking(overrides, final_returns, eval_returns),
        }
    write_json(os.path.join(run_dir, "summary.json"), summary)
    plot_learning_curve(
        csv_path,
        os.path.join(run_dir, "learning_curve.png"),
        f"{trainer.algo} {trainer.env_id}",
        trainer.headline_metric,
        trainer.step_unit,
        [config_label(values) for values in overrides] if config.sweep else None,
    )
    if wandb_sink is not None:
        wandb_sink.finish(summary)
    evaluated = (
        f"eval {summary['eval_return_mean']:.1f}, "
        if config.eval_episodes and trainer.evaluate is not None
        else ""
    )
    headline = "return" if trainer.headline_metric == "episode_return" else trainer.headline_metric
    result = (
        f"final {headline} {summary['final_return_mean']:.3g} ± {summary['final_return_std']:.2g}"
    )
    if config.sweep:
        best = summary["sweep"]["ranking"][0]
        result = (
            f"best of {num_configs} configs {config_label(best['hyperparams'])}: final "
            f"{headline} {best['final_return_mean']:.3g} ± {best['final_return_std']:.2g}"
        )
        evaluated = f"eval {best['eval_return_mean']:.1f}, " if evaluated else ""
    print(
        f"{trainer.algo} {trainer.env_id}: {result} over {num_seeds} seed(s), "
        f"{evaluated}{steps_per_second:,.0f} {trainer.step_unit}/s, "
        f"compile {summary['compile_seconds']:.1f} s, wall {summary['wall_seconds']:.1f} s "
        f"-> {run_dir}"
    )
    if multi_process:
        multihost_utils.sync_global_devices(_REPORTED_BARRIER)
    return (summary, state) if return_state else summary
