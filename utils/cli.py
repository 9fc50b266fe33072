"""Command line: the run flags every trainer shares, env presets, `--resume` and exit codes."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable

import numpy as np
import tyro

from utils import interrupts
from utils.envs import env_family, resolve_env_id
from utils.errors import ConfigError, OutputError
from utils.logs import read_json


@dataclasses.dataclass
class RunConfig:
    """Flags of the run itself (seeds, devices, logging, output), not of the algorithm."""

    seed: int = 1
    """seed of the first run; seed i of `--num-seeds N` uses seed + i"""
    num_seeds: int = 1
    """independent seeds trained at once in one compiled program (jax.vmap)"""
    sweep: tuple[str, ...] = ()
    """NAME=V1,V2,... ...: train every combination of these hyperparameter values, each with
    --num-seeds seeds, in one compiled program (e.g. --sweep lr=1e-3,3e-4 ent-coef=0,0.01).
    Only values that change no array shape can vary: learning rate, discounts, coefficients,
    exploration and search temperatures; summary.json ranks the configurations"""
    num_devices: int = 0
    """devices to split the environments over (jax.pmap); 0 means all local devices"""
    cpu_devices: int = 0
    """on a CPU-only host, split the CPU into this many XLA devices (-1: one per core; the
    process restarts itself once to apply it); 0 keeps JAX's single CPU device. Ignored on
    GPU/TPU hosts"""
    distributed: bool = False
    """join a multi-process run (jax.distributed; every process runs the same command): on
    SLURM, Open MPI, Kubernetes and Cloud TPU, JAX finds its peers itself; elsewhere give
    --coordinator-address, --num-processes and --process-id. Gradients are averaged over every
    device of every process; process 0 alone writes the run directory"""
    coordinator_address: str | None = None
    """host:port of process 0 in a multi-process run (implies --distributed; default
    $JAX_COORDINATOR_ADDRESS or the cluster's)"""
    num_processes: int | None = None
    """processes in a multi-process run (implies --distributed; default $JAX_NUM_PROCESSES or
    the cluster's)"""
    process_id: int | None = None
    """this process's index in a multi-process run, 0 to num_processes - 1 (implies
    --distributed; default $JAX_PROCESS_ID or the cluster's)"""
    track: bool = False
    """log to Weights & Biases (never contacted unless this is set): at most 1,000 points a
    curve, each the mean of consecutive updates; metrics.csv keeps every update"""
    wandb_project_name: str = "purejaxrl"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team); None uses your default"""
    progress: bool = True
    """show a progress bar with return, steps/s and ETA"""
    compile_cache: bool = True
    """keep compiled programs in a per-user cache ($JAX_COMPILATION_CACHE_DIR, else
    ~/.cache/purejaxrl/jax), so that a repeated run skips most of its compilation"""
    updates_per_chunk: int = 0
    """updates per compiled chunk; between chunks the driver logs and checkpoints (0: automatic)"""
    runs_dir: str = "runs"
    """folder that holds one directory per run"""
    resume: str | None = None
    """continue the run in this run directory from its latest checkpoint"""
    checkpoint_every: int = 0
    """chunks between checkpoints; 0: automatic, after every chunk unless writing them would
    take more than about 5% of the training time (a large replay buffer over many seeds).
    Where a run stops (its end, Ctrl-C, SIGTERM, divergence) its state is saved all the same"""
    keep_checkpoints: int = 1
    """checkpoints kept in RUN_DIR/checkpoints, the newest ones (0: all): older ones let
    AlphaZero's --arena RUN_DIR@update=N compare a run with its own past"""
    allow_nonfinite: bool = False
    """train on when a loss or a parameter turns NaN or inf (to study divergence). By default
    such a run stops after that chunk, keeps its last finite checkpoint, marks summary.json
    "diverged" and exits with code 3"""
    reevaluate: tyro.conf.Suppress[bool] = False
    """set by `parse_config` for --resume with --eval-episodes or --eval-games on the command
    line: a finished run evaluates its final state again"""


@dataclasses.dataclass
class EpisodeRunConfig(RunConfig):
    """Run flags of the trainers that play gymnax episodes: the evaluation and the video after
    training."""

    eval_episodes: int = 10
    """greedy evaluation episodes of the final policy, per seed (0 to skip)"""
    capture_video: bool = False
    """after training, film one greedy episode of the first seed with gymnax's renderer into
    RUN_DIR/videos/final.gif (and wandb with --track)"""


# Fields that may differ from the saved config when resuming: they change how the run is
# watched, not what it computes.
RESUMABLE_OVERRIDES = frozenset(
    {
        "resume",
        "progress",
        "compile_cache",
        "updates_per_chunk",
        "track",
        "wandb_project_name",
        "wandb_entity",
        "keep_checkpoints",
        "checkpoint_every",
    }
    | {"eval_episodes", "runs_dir", "capture_video", "eval_games", "record_games"}
    | {"allow_nonfinite", "reevaluate"}
)
# The size of the final evaluation, in the trainers that have one; given with --resume of a
# finished run, it asks for that evaluation again.
EVAL_SIZE_FIELDS = ("eval_episodes", "eval_games")


def _flag_value(args: list[str], name: str) -> str | None:
    """Value of `--name X` / `--name=X` (dashes or underscores) in raw argv, last one wins."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    value = None
    for i, arg in enumerate(args):
        flag, eq, inline = arg.partition("=")
        if flag in spellings:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def load_saved_config(run_dir: str) -> dict:
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        raise ConfigError(f"--resume: run directory {run_dir!r} does not exist")
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: {run_dir!r} has no config.json, so it is not a run directory")
    return read_json(path, "--resume")


def gymnax_preset_keys(env: str) -> tuple[str, str]:
    """The presets of a gymnax env, the more general first: its family ('classic', 'minatar',
    'continuous', ...), then its own id, whose entries (if any) refine the family's."""
    env_id = resolve_env_id(env)
    return env_family(env_id), env_id


def parse_config(
    config_cls,
    presets: dict[str, dict],
    args: list[str] | None = None,
    preset_key: Callable[[str], str | tuple[str, ...]] = gymnax_preset_keys,
    shell_defaults: dict | None = None,
):
    """Parse argv into `config_cls`, with defaults from the env's preset or the resumed run.

    `preset_key` names the env's preset, or its presets from the most general to the most
    specific, each overriding the ones before. The preset is chosen before parsing, so
    `--env Breakout --help` shows Breakout's defaults and any flag still overrides them.
    `shell_defaults` are defaults of the command line only, below the preset's (e.g. a CPU
    split, which restarts the process: a Config built in a notebook never asks for it). With
    `--resume RUN_DIR` the saved config is the default, a flag that changes something the run
    computes is refused, and an evaluation size on the command line (EVAL_SIZE_FIELDS) sets
    `reevaluate`.
    """
    args = list(sys.argv[1:] if args is None else args)
    resume = _flag_value(args, "resume")
    if resume is not None:
        saved = load_saved_config(resume)
        names = {f.name for f in dataclasses.fields(config_cls)}
        # JSON stores tuples (--sweep) as lists
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
        default = config_cls(**{k: v for k, v in saved.items() if k in names})
    else:
        env = _flag_value(args, "env") or config_cls.env
        keys = preset_key(env)
        preset = {}
        for key in (keys,) if isinstance(keys, str) else keys:
            preset.update(presets.get(key, {}))
        default = config_cls(**{**(shell_defaults or {}), **preset, "env": env})
    config = tyro.cli(config_cls, default=default, args=args, description=config_cls.__doc__)
    if resume is not None:
        for field in dataclasses.fields(config_cls):
            new, old = getattr(config, field.name), getattr(default, field.name)
            if field.name not in RESUMABLE_OVERRIDES and new != old:
                flag = "--" + field.name.replace("_", "-")
                raise ConfigError(
                    f"--resume: {flag}={new} conflicts with {old} saved in "
                    f"{os.path.join(resume, 'config.json')}; drop the flag or start a new run"
                )
        asked = [n for n in EVAL_SIZE_FIELDS if n in names and _flag_value(args, n) is not None]
        config = dataclasses.replace(config, reevaluate=bool(asked))
    return config


# The compiled programs hold sizes, counts and integer hyperparameters as 32-bit integers.
INT32_MAX = 2**31 - 1


def require_positive(
    config, *names: str, minimum: int = 1, maximum: int | None = INT32_MAX
) -> None:
    """ConfigError for the first of these integer fields that is below `minimum` or above
    `maximum`: by default INT32_MAX, since a size, count or hyperparameter beyond it would fail
    inside JAX with an overflow (None: a field that never reaches the compiled program)."""
    for name in names:
        value, flag = getattr(config, name), "--" + name.replace("_", "-")
        if value < minimum:
            raise ConfigError(f"{flag} must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{flag} must be <= {maximum}, got {value}")


# The compiled programs hold float hyperparameters as float32.
FLOAT32_MAX = float(np.finfo(np.float32).max)


def require_in(config, name: str, low: float, high: float = math.inf, *, above_low=False) -> None:
    """ConfigError unless the float field is finite and in [low, high] ((low, high] with
    `above_low`). NaN fails every comparison, so it is named here rather than let through; a
    value beyond FLOAT32_MAX would become infinite in the compiled program."""
    value = getattr(config, name)
    inside = low < value if above_low else low <= value
    flag = "--" + name.replace("_", "-")
    if not (math.isfinite(value) and inside and value <= high):
        bounds = (
            f"{'(' if above_low else '['}{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"
        )
        raise ConfigError(f"{flag} must be a finite number in {bounds}, got {value}")
    if abs(value) > FLOAT32_MAX:
        raise ConfigError(f"{flag} {value} is beyond float32, which the compiled program uses")


@contextlib.contextmanager
def exit_on_config_error():
    """The command line around a trainer's run, which ends the process: a ConfigError is one
    line on stderr and exit code 2; an OutputError (a file of the run that could not be
    written), one line and exit code 1; Ctrl-C or SIGTERM at any moment, one line and exit code
    130 (utils/interrupts.py, whose `end_process` skips the interpreter's teardown)."""
    interrupts.exit_at_once_on_stop_signals()
    try:
        yield
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        interrupts.end_process(2)
    except OutputError as error:
        print(f"error: {error}", file=sys.stderr)
        interrupts.end_process(1)
    except SystemExit as exit_request:  # an interrupted run's 130, --help's 0, tyro's 2
        if not isinstance(exit_request.code, int | None):
            raise
        interrupts.end_process(exit_request.code or 0)
    interrupts.end_process(0)
