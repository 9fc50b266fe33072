"""Training throughput and compile time at the anchors' own settings: ours next to PureJaxRL's
loops, alternating in one process.

    python benchmarks/yardstick.py                          # the three workloads, 2 rounds
    python benchmarks/yardstick.py --workloads dqn_cartpole --rounds 3 --unrolled-anchor
    python benchmarks/yardstick.py --workloads ppo_cartpole --presets

Workloads (`--workloads`, comma-separated):
- ppo_cartpole: PureJaxRL's ppo.py at its CartPole configuration, 5e5 steps (4 envs x 128
  steps, 4 epochs of 4 minibatches, learning rate 2.5e-4 annealed, 64-unit tanh MLPs).
- ppo_breakout: its MinAtar configuration on Breakout-MinAtar, 2e6 steps (64 envs x 128 steps,
  4 epochs of 8 minibatches, learning rate 5e-3 annealed, 64-unit ReLU MLPs).
- dqn_cartpole: its dqn.py at its CartPole configuration, 5e5 steps (10 envs, a flashbax buffer
  of 10k, a 120-84 MLP, one Adam step on 128 transitions every 10 env steps, 1-step targets,
  epsilon annealed over 2.5e5 steps).

The anchors are rebuilt in benchmarks/references.py and run as their scripts do: the whole run
one jitted `lax.scan`, no logging callback, JAX's default CPU lowering of random numbers (as
their users get it; `--unrolled-anchor` adds a run with the lowering our driver may switch on,
utils/devices.py, which shows how much of a difference that switch is).

Ours runs through the normal driver, as a user's run does: chunked training, the progress bar
(`--no-progress` turns it off), metrics.csv and checkpoints at their default frequency; only
the evaluation after training is off (`--eval-episodes 0`), since the anchors have none, and
the persistent compilation cache, so that every run compiles from scratch. JAX's in-memory
caches are cleared before every run. `--presets` adds ours at its own preset on each workload.

Every setting of a workload runs once per round, in turn, so that a machine's drifting speed
hits all of them. Env steps/s exclude compilation; compile seconds are the anchor's lowering and
compilation of its whole run, and our driver's `compile_seconds` (every chunk program it built).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_dqn
import purejaxrl_ppo
from benchmarks.references import PPO_CARTPOLE, PPO_MINATAR, reference_dqn, reference_ppo
from utils.cli import parse_config
from utils.devices import unroll_threefry_on_cpu, use_compile_cache
from utils.driver import run_training
from utils.logs import write_json


@dataclasses.dataclass
class Args:
    workloads: str = "ppo_cartpole,ppo_breakout,dqn_cartpole"
    """comma-separated: ppo_cartpole, ppo_breakout, dqn_cartpole"""
    rounds: int = 2
    """times every setting runs, alternating"""
    total_timesteps: int | None = None
    """replace every workload's env steps (for a smoke test)"""
    unrolled_anchor: bool = False
    """also run each anchor with the unrolled threefry lowering"""
    presets: bool = False
    """also run ours at its preset on each workload"""
    progress: bool = True
    """keep our progress bar on, as a user would"""
    out: str | None = None
    """also write the results to this JSON file"""


class Workload(NamedTuple):
    """An anchor at its own settings, and the flags that give ours the same settings."""

    anchor_name: str
    env: str
    total_timesteps: int
    anchor: Any  # total_timesteps -> ReferenceLoop
    trainer: Any  # our trainer's module
    flags: tuple[str, ...]  # ours at the anchor's settings, on top of the env's preset


def _ppo_flags(s) -> tuple[str, ...]:
    """Our PPO flags for PureJaxRL's settings `s` (its defaults for the rest match ours)."""
    return (
        *("--learning-rate", str(s.learning_rate), "--num-envs", str(s.num_envs)),
        *("--num-steps", str(s.num_steps), "--update-epochs", str(s.update_epochs)),
        *("--num-minibatches", str(s.num_minibatches), "--activation", s.activation),
        *("--ent-coef", str(s.ent_coef), "--hidden-size", "64", "--no-shared-torso"),
    )


WORKLOADS = {
    "ppo_cartpole": Workload(
        "PureJaxRL ppo.py",
        "CartPole",
        500_000,
        lambda steps: reference_ppo("CartPole", PPO_CARTPOLE._replace(total_timesteps=steps)),
        purejaxrl_ppo,
        _ppo_flags(PPO_CARTPOLE),
    ),
    "ppo_breakout": Workload(
        "PureJaxRL MinAtar PPO",
        "Breakout",
        2_000_000,
        lambda steps: reference_ppo("Breakout", PPO_MINATAR._replace(total_timesteps=steps)),
        purejaxrl_ppo,
        _ppo_flags(PPO_MINATAR),
    ),
    "dqn_cartpole": Workload(
        "PureJaxRL dqn.py",
        "CartPole",
        500_000,
        lambda steps: reference_dqn("CartPole", steps),
        purejaxrl_dqn,
        (
            *("--num-envs", "10", "--learning-rate", "2.5e-4", "--hidden-sizes", "120", "84"),
            *("--n-step", "1", "--no-double-dqn", "--max-grad-norm", "0"),
            *("--buffer-size", "10000", "--exploration-fraction", "0.5"),
        ),
    ),
}


def anchor_run(workload: Workload, total_timesteps: int, unrolled: bool) -> tuple[float, float]:
    """(env steps/s, compile s) of the anchor's whole run as one jitted scan."""
    unroll_threefry_on_cpu(unrolled)
    loop = workload.anchor(total_timesteps)

    def train(key):
        return jax.lax.scan(loop.update, loop.init(key), None, loop.num_updates)

    key = jax.random.PRNGKey(0)
    start = time.perf_counter()
    compiled = jax.jit(train).lower(key).compile()
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(key))
    steps = loop.num_updates * loop.steps_per_update
    return steps / (time.perf_counter() - start), compile_seconds


def ours_config(
    workload: Workload,
    total_timesteps: int,
    flags,
    *,
    progress: bool = False,
    runs_dir: str = "runs",
):
    """Our trainer's config for a run of `workload` with `flags`, as `ours_run` trains it."""
    cli = ["--env", workload.env, "--total-timesteps", str(total_timesteps), *flags]
    cli += ["--runs-dir", runs_dir, "--eval-episodes", "0", "--no-compile-cache"]
    cli += [] if progress else ["--no-progress"]
    return parse_config(workload.trainer.Config, workload.trainer.PRESETS, cli)


def ours_run(
    workload: Workload, total_timesteps: int, flags, *, progress: bool, runs_dir: str
) -> tuple[float, float]:
    """(env steps/s, compile s) of our trainer through the driver, as a user runs it."""
    config = ours_config(workload, total_timesteps, flags, progress=progress, runs_dir=runs_dir)
    module = workload.trainer
    summary = run_training(config, module.make_train, module.validate)
    return summary["steps_per_second"], summary["compile_seconds"]


def settings_of(workload: Workload, args: Args) -> dict[str, Any]:
    """Setting name -> what to run: True/False for the anchor (unrolled threefry or not), a
    flag list for ours."""
    settings: dict[str, Any] = {f"{workload.anchor_name} loop": False}
    if args.unrolled_anchor:
        settings[f"{workload.anchor_name} loop, unrolled threefry"] = True
    settings["ours at its settings"] = list(workload.flags)
    if args.presets:
        settings["ours at our preset"] = []
    return settings


def measure(name: str, args: Args, runs_dir: str) -> list[dict]:
    """One row per setting of a workload, its runs alternating over the rounds."""
    workload = WORKLOADS[name]
    total_timesteps = args.total_timesteps or workload.total_timesteps
    settings = settings_of(workload, args)
    measured = {setting: [] for setting in settings}
    for _ in range(args.rounds):
        for setting, what in settings.items():
            jax.clear_caches()
            if isinstance(what, bool):
                measured[setting].append(anchor_run(workload, total_timesteps, what))
            else:
                run = ours_run(
                    workload, total_timesteps, what, progress=args.progress, runs_dir=runs_dir
                )
                measured[setting].append(run)
    # setting -> [median env steps/s, median compile s]
    medians = {setting: np.median(np.asarray(runs), axis=0) for setting, runs in measured.items()}
    anchor = medians[f"{workload.anchor_name} loop"]
    return [
        {
            "workload": name,
            "setting": setting,
            "env": workload.env,
            "total_timesteps": total_timesteps,
            "steps_per_second": [round(sps) for sps, _ in runs],
            "compile_seconds": [round(c, 2) for _, c in runs],
            "throughput_ratio": round(float(medians[setting][0] / anchor[0]), 3),
            "compile_ratio": round(float(medians[setting][1] / anchor[1]), 3),
            "devices": f"{jax.local_device_count()} x {jax.devices()[0].device_kind}",
        }
        for setting, runs in measured.items()
    ]


def main(args: Args) -> list[dict]:
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown or args.rounds < 1:
        problem = f"unknown workloads {unknown}" if unknown else "--rounds must be at least 1"
        print(f"error: {problem}; choose from {sorted(WORKLOADS)}.", file=sys.stderr)
        raise SystemExit(2)
    use_compile_cache(False)  # the anchors too compile every run from scratch
    results = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for name in names:
            results += measure(name, args, runs_dir)
    print(
        "| workload | setting | env steps/s (each round) | compile s (each round) "
        "| throughput ratio | compile ratio |"
    )
    print("|---|---|---|---|---:|---:|")
    for r in results:
        steps = " / ".join(f"{s:,}" for s in r["steps_per_second"])
        compiles = " / ".join(f"{c:.1f}" for c in r["compile_seconds"])
        print(
            f"| {r['workload']} | {r['setting']} | {steps} | {compiles} "
            f"| {r['throughput_ratio']} | {r['compile_ratio']} |"
        )
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
