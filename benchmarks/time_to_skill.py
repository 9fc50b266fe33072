"""Time to skill: wall-clock seconds from the start of a run to a policy of a given quality,
ours next to an anchor, each at its own recommended settings, alternating in one process.

    python benchmarks/time_to_skill.py                  # every workload below, 3 seeds each
    python benchmarks/time_to_skill.py --workloads ppo_cartpole,dqn_cartpole --seeds 5
    python benchmarks/time_to_skill.py --workloads az_connect_four   # the slowest (docs/benchmarks.md)

Workloads (`--workloads`, comma-separated; all five by default):
- ppo_cartpole: PPO on CartPole-v1 to a return of 475; anchor PureJaxRL's ppo.py.
- dqn_cartpole: DQN on CartPole-v1 to 475; anchor PureJaxRL's dqn.py.
- az_tic_tac_toe: AlphaZero to its first evaluation without a loss against a perfect
  (minimax) player; anchor pgx's AlphaZero example, whole loop (self-play, targets, SGD).
- ppo_breakout: PPO on Breakout-MinAtar to 28; anchor PureJaxRL's MinAtar PPO.
- az_connect_four: AlphaZero to a score of 90% against plain MCTS of 64 simulations.

The anchors are rebuilt in benchmarks/references.py. Both sides are judged by the same
evaluator. For PPO and DQN it is the mean return of the training episodes that ended within a
chunk of training, as PureJaxRL reports returns; each side runs in chunks of about a 25th of
its run (the driver's automatic chunking, the same rule for the anchor). For AlphaZero it is
utils/board_eval.py's match of 64 games, the agent's greedy search (32 simulations) against the
opponent: ours runs it at the end of every chunk of --eval-every iterations as part of its
training; the anchor's network is evaluated after each of its iterations, and that evaluation
is not counted in the anchor's time.

The time to skill is the wall time until the end of the chunk in which the evaluator first
meets the threshold: with compilation, from the start of the run (ours: from `run_training`,
so flag parsing, building, compiling, training, logs and checkpoints), and without it. Ours
is checked by the driver after each chunk (`run_training`'s `stop_when`, on the chunk's
metrics), stops there and reads the chunk's end from summary.json's "chunk_ends"; the anchors
are checked between their chunks, never inside one. Neither side uses a persistent
compilation cache, and JAX's in-memory caches are cleared before each side of each seed, so
every seed compiles from scratch. Each seed runs ours and the anchor one after the other, the
first of the two alternating from seed to seed, so that a machine's drifting speed hits both.
PPO and DQN run on one device, as ours does by default; AlphaZero on the host split into one
CPU device per core (`--cpu-devices`), our command line's default.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pgx
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_az
import purejaxrl_dqn
import purejaxrl_ppo
from benchmarks.references import (
    AZ_ON_CPU,
    PPO_CARTPOLE,
    PPO_MINATAR,
    ReferenceAlphaZero,
    ReferenceLoop,
    ReferenceNet,
    reference_dqn,
    reference_ppo,
)
from utils.board_eval import evaluate_agent, opponents, solve_tic_tac_toe
from utils.cli import parse_config
from utils.devices import DEVICE_AXIS, split_cpu_host, unroll_threefry_on_cpu, use_compile_cache
from utils.driver import auto_updates_per_chunk, run_training
from utils.logs import write_json
from utils.trainer import hyperparams_of

DEFAULT_WORKLOADS = "ppo_cartpole,dqn_cartpole,az_tic_tac_toe,ppo_breakout,az_connect_four"


@dataclasses.dataclass
class Args:
    workloads: str = DEFAULT_WORKLOADS
    """comma-separated: ppo_cartpole, dqn_cartpole, az_tic_tac_toe, ppo_breakout,
    az_connect_four"""
    seeds: int = 3
    """seeds per side and workload"""
    cpu_devices: int = -1
    """split the CPU into this many XLA devices first (-1: one per core; 0: JAX's default)"""
    smoke: bool = False
    """tiny runs on both sides, to check the script (not a measurement)"""
    threshold: float | None = None
    """replace every workload's threshold (for a smoke test)"""
    out: str | None = None
    """also write the results to this JSON file"""


class Chunk(NamedTuple):
    """Where an anchor stands after one of its chunks."""

    steps: int  # env steps (or moves) trained so far
    value: float  # the evaluator's value after this chunk
    compile_seconds: float  # so far
    uncounted_seconds: float  # so far: the benchmark's own evaluation of the anchor


class Workload(NamedTuple):
    """A task, its threshold, and how each side trains on it."""

    goal: str  # the threshold in words
    metric: str  # ours: the metrics.csv column the evaluator reads
    threshold: float
    lower_is_better: bool
    trainer: Any  # our trainer's module
    flags: str  # ours, at its preset
    smoke_flags: str
    # (key, smoke) -> the anchor's chunks, lazily: nothing runs before the first is asked for
    anchor: Callable[[jax.Array, bool], Iterator[Chunk]]
    anchor_name: str

    def reached(self, value: float, threshold: float) -> bool:
        """Whether the evaluator's value meets the threshold (NaN, nothing to judge, does not)."""
        if not np.isfinite(value):
            return False
        return value <= threshold if self.lower_is_better else value >= threshold


# ---------------------------------------------------------------------------------------------
# The anchors, chunk by chunk
# ---------------------------------------------------------------------------------------------


def episode_loop_chunks(make_loop: Callable[[], ReferenceLoop], key) -> Iterator[Chunk]:
    """A PureJaxRL loop in chunks of the driver's automatic length, each one compiled scan;
    after each, the mean return of the episodes that ended in it. JAX's default CPU lowering
    of its random numbers, as PureJaxRL's users get it."""
    unroll_threefry_on_cpu(False)
    start = time.perf_counter()
    loop = make_loop()
    carry = jax.jit(loop.init)(key)
    chunk_len = auto_updates_per_chunk(loop.num_updates)
    compiled, compile_seconds, done = {}, time.perf_counter() - start, 0
    while done < loop.num_updates:
        length = min(chunk_len, loop.num_updates - done)
        if length not in compiled:
            start = time.perf_counter()
            scan = functools.partial(jax.lax.scan, loop.update, xs=None, length=length)
            compiled[length] = jax.jit(scan).lower(carry).compile()
            compile_seconds += time.perf_counter() - start
        carry, metrics = compiled[length](carry)
        metrics = jax.device_get(metrics)
        done += length
        episodes = metrics["episodes"].sum()
        value = metrics["return_sum"].sum() / episodes if episodes else float("nan")
        yield Chunk(done * loop.steps_per_update, float(value), compile_seconds, 0.0)


def ppo_anchor(env_name: str, settings, smoke_settings):
    """PureJaxRL's PPO at `settings` (`smoke_settings` for --smoke), chunk by chunk."""

    def chunks(key, smoke: bool) -> Iterator[Chunk]:
        make = functools.partial(reference_ppo, env_name, smoke_settings if smoke else settings)
        return episode_loop_chunks(make, key)

    return chunks


def dqn_anchor(key, smoke: bool) -> Iterator[Chunk]:
    """PureJaxRL's DQN on CartPole, 5e5 steps as dqn.py (2,000 for --smoke), chunk by chunk."""
    return episode_loop_chunks(
        functools.partial(reference_dqn, "CartPole", 2_000 if smoke else 500_000), key
    )


def anchor_evaluator(game: str, opponent: str, settings, eval_games: int) -> Callable:
    """`evaluate(variables, key) -> {metric: value}`: our in-loop evaluation (utils/board_eval.py,
    the agent's greedy Gumbel search as ours searches) of the anchor's network, against one
    opponent, pmapped over the local devices like the anchor."""
    env = pgx.make(game)
    devices = jax.local_device_count()
    config = purejaxrl_az.Config(env=game)
    net = ReferenceNet(env.num_actions, settings.num_channels, settings.num_layers)
    hp = hyperparams_of(purejaxrl_az.HyperParams, config)
    oracle_table = jnp.asarray(solve_tic_tac_toe()) if game == "tic_tac_toe" else None
    mcts = functools.partial(
        purejaxrl_az.plain_search, env=env, num_simulations=config.baseline_sims
    )
    players = {opponent: opponents(env, mcts, oracle_table)[opponent]}

    def evaluate(variables, key):
        def agent(games, key):
            output = purejaxrl_az.agent_search(
                variables,
                hp,
                key,
                games,
                env=env,
                network=net,
                search="gumbel",
                num_simulations=settings.num_simulations,
                max_num_considered_actions=config.max_num_considered_actions,
                greedy=True,
            )
            return output.action

        return evaluate_agent(
            agent,
            key,
            env=env,
            players=players,
            num_games=eval_games // devices,
            oracle_table=oracle_table,
            capture_video=False,
        )

    pmapped = jax.pmap(evaluate, axis_name=DEVICE_AXIS)

    def values(variables, key) -> dict:
        metrics = jax.device_get(pmapped(variables, jax.random.split(key, devices)))
        return {name: float(value[0]) for name, value in metrics.items()}

    return values


def az_anchor(game: str, opponent: str, metric: str, max_iterations: int):
    """pgx's AlphaZero example on `game`, evaluated against `opponent` after every iteration,
    for at most `max_iterations` iterations (2 of tiny sizes for --smoke)."""
    smoke_settings = AZ_ON_CPU._replace(
        selfplay_batch_size=16,
        max_num_steps=4,
        training_batch_size=16,
        num_simulations=4,
        num_channels=8,
        num_layers=1,
    )

    @functools.cache
    def evaluator(smoke: bool):  # compiled once, for every seed: it is not timed
        settings = smoke_settings if smoke else AZ_ON_CPU
        return anchor_evaluator(game, opponent, settings, 4 if smoke else 64)

    def chunks(key, smoke: bool) -> Iterator[Chunk]:
        unroll_threefry_on_cpu(False)
        start = time.perf_counter()
        anchor = ReferenceAlphaZero(game, smoke_settings if smoke else AZ_ON_CPU)
        init_key, compile_key, key = jax.random.split(key, 3)
        variables, opt_state = anchor.init(init_key)
        anchor.compile(variables, opt_state, compile_key)
        compile_seconds, uncounted = time.perf_counter() - start, 0.0
        for iteration in range(1, (2 if smoke else max_iterations) + 1):
            key, iteration_key, eval_key = jax.random.split(key, 3)
            variables, opt_state = anchor.iterate(variables, opt_state, iteration_key)
            jax.block_until_ready(variables)
            start = time.perf_counter()
            value = evaluator(smoke)(variables, eval_key)[metric]
            uncounted += time.perf_counter() - start
            steps = iteration * anchor.moves_per_iteration
            yield Chunk(steps, value, compile_seconds, uncounted)

    return chunks


# ---------------------------------------------------------------------------------------------
# The workloads
# ---------------------------------------------------------------------------------------------

AZ_SMOKE = (
    "--num-games 16 --rollout-steps 4 --buffer-size 256 --num-iterations 2 --minibatch-size 16 "
    "--eval-every 2 --eval-games 4 --num-simulations 4 --baseline-sims 2 --num-channels 8 "
    "--num-blocks 1"
)
PPO_SMOKE = "--num-envs 4 --num-steps 16 --num-minibatches 2 --total-timesteps 2048"
PPO_SMOKE_ANCHOR = PPO_CARTPOLE._replace(num_steps=16, num_minibatches=2, total_timesteps=2048)

WORKLOADS = {
    "ppo_cartpole": Workload(
        "return 475",
        "episode_return",
        475.0,
        False,
        purejaxrl_ppo,
        "--env CartPole",
        f"--env CartPole {PPO_SMOKE}",
        ppo_anchor("CartPole", PPO_CARTPOLE, PPO_SMOKE_ANCHOR),
        "PureJaxRL ppo.py",
    ),
    "dqn_cartpole": Workload(
        "return 475",
        "episode_return",
        475.0,
        False,
        purejaxrl_dqn,
        "--env CartPole",
        "--env CartPole --total-timesteps 2000 --learning-starts 500 --buffer-size 1000",
        dqn_anchor,
        "PureJaxRL dqn.py",
    ),
    # the anchor: at most twice the moves of our preset's 100 iterations
    "az_tic_tac_toe": Workload(
        "no loss vs minimax",
        "eval_oracle_loss",
        0.0,
        True,
        purejaxrl_az,
        "--env tic_tac_toe",
        f"--env tic_tac_toe {AZ_SMOKE}",
        az_anchor("tic_tac_toe", "oracle", "eval_oracle_loss", max_iterations=13),
        "pgx AlphaZero example",
    ),
    "ppo_breakout": Workload(
        "return 28",
        "episode_return",
        28.0,
        False,
        purejaxrl_ppo,
        "--env Breakout",
        f"--env Breakout {PPO_SMOKE}",
        ppo_anchor("Breakout", PPO_MINATAR, PPO_MINATAR._replace(num_envs=4, total_timesteps=2048)),
        "PureJaxRL MinAtar PPO",
    ),
    # the anchor: at most twice the moves of our preset's 300 iterations
    "az_connect_four": Workload(
        "score 0.9 vs MCTS-64",
        "eval_mcts_score",
        0.9,
        False,
        purejaxrl_az,
        "--env connect_four",
        f"--env connect_four {AZ_SMOKE}",
        az_anchor("connect_four", "mcts", "eval_mcts_score", max_iterations=75),
        "pgx AlphaZero example",
    ),
}


# ---------------------------------------------------------------------------------------------
# One seed of each side: the time to the threshold
# ---------------------------------------------------------------------------------------------


def crossing(reached: bool, wall: float, compile_seconds: float, steps: int) -> dict:
    """One side's result for one seed: where the threshold was first met, or, if it never
    was, where its budget ran out."""
    return {
        "reached": reached,
        "wall_seconds": round(wall, 2),
        "train_seconds": round(wall - compile_seconds, 2),
        "compile_seconds": round(compile_seconds, 2),
        "steps": int(steps),
    }


def anchor_time(workload: Workload, seed: int, smoke: bool, threshold: float) -> dict:
    """Run the anchor chunk by chunk until its evaluator meets the threshold."""
    jax.clear_caches()  # it compiles from scratch, as a fresh process would
    start = time.perf_counter()
    chunk = None
    for chunk in workload.anchor(jax.random.PRNGKey(seed), smoke):
        wall = time.perf_counter() - start - chunk.uncounted_seconds
        if workload.reached(chunk.value, threshold):
            return crossing(True, wall, chunk.compile_seconds, chunk.steps)
    return crossing(False, wall, chunk.compile_seconds, chunk.steps)


def chunk_value(workload: Workload, rows: dict) -> float:
    """The evaluator's value from the metrics of one of our chunks: the mean return of
    the episodes that ended in it, or the evaluation at its end."""
    if workload.metric != "episode_return":
        return float(rows[workload.metric][-1])
    ended = rows["episodes"] > 0
    episodes = rows["episodes"][ended].sum()
    return (
        float((rows["episode_return"] * rows["episodes"])[ended].sum() / episodes)
        if episodes
        else float("nan")
    )


def ours_time(workload: Workload, seed: int, args: Args, runs_dir: str, threshold: float) -> dict:
    """Run our trainer through the driver at its preset until the end of the first chunk whose
    value meets the threshold (the driver's `stop_when`), or to the end of its budget."""
    jax.clear_caches()  # it compiles from scratch, as a fresh process would
    trainer = workload.trainer
    flags = workload.smoke_flags if args.smoke else workload.flags
    cli = [*flags.split(), "--seed", str(seed), "--runs-dir", runs_dir, "--no-progress"]
    cli += ["--no-compile-cache"]
    if trainer is purejaxrl_az:
        cli += ["--cpu-devices", str(args.cpu_devices)]  # the command line's default: -1
        config = parse_config(
            trainer.Config, trainer.PRESETS, cli, preset_key=purejaxrl_az.resolve_game
        )
    else:  # one device, as on an unsplit host; no evaluation after training, none is timed
        cli += ["--num-devices", "1", "--eval-episodes", "0"]
        config = parse_config(trainer.Config, trainer.PRESETS, cli)

    met_at = []  # the update whose chunk first met the threshold

    def met(update: int, metrics: dict) -> bool:  # metrics {name: [1 run, chunk's updates]}
        value = chunk_value(workload, {name: v[0] for name, v in metrics.items()})
        if workload.reached(value, threshold):
            met_at.append(update)
        return bool(met_at)

    summary = run_training(config, trainer.make_train, trainer.validate, stop_when=met)
    end = summary["chunk_ends"][-1]  # where it stopped: the crossing, or the budget's end
    steps = end["update"] * (summary["env_steps_per_seed"] // summary["num_updates"])
    reached = bool(met_at)
    return crossing(reached, end["wall_seconds"], end["compile_seconds"], steps)


# ---------------------------------------------------------------------------------------------
# Medians, spreads, ratios and the table
# ---------------------------------------------------------------------------------------------


def median_of(runs: list[dict], field: str) -> tuple[float, bool]:
    """(the median over seeds, whether it is only a lower bound). A seed that never met the
    threshold counts as slower than every seed that did; if the median involves one, its
    value where its budget ran out makes the median a lower bound."""
    ordered = sorted(runs, key=lambda run: (not run["reached"], run[field]))
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]
    median = float(np.mean([run[field] for run in middle]))
    return median, not all(run["reached"] for run in middle)


def summarise(runs: list[dict]) -> dict:
    """Median, lower-bound flag, min and max of every field over the seeds."""
    out = {"reached": sum(run["reached"] for run in runs), "seeds": len(runs)}
    for field in ("wall_seconds", "train_seconds", "steps"):
        median, bound = median_of(runs, field)
        values = [run[field] for run in runs]
        out[field] = {
            "median": median,
            "lower_bound": bound,
            "min": min(values),
            "max": max(values),
        }
    return out


def ratio(anchor: dict, ours: dict) -> str:
    """anchor / ours of the medians: above 1, ours is faster; '>' or '<' where a median is a
    bound (a side that did not meet the threshold in most seeds)."""
    if anchor["lower_bound"] and ours["lower_bound"]:
        return "n/a"
    value = f"{anchor['median'] / ours['median']:.2f}"
    return f">{value}" if anchor["lower_bound"] else f"<{value}" if ours["lower_bound"] else value


def cell(stats: dict, integer: bool = False) -> str:
    """'median (min-max)', '>' before a median that is a lower bound."""

    def number(x):
        return (
            f"{x / 1000:,.0f}k"
            if integer and x >= 10_000
            else f"{x:,.0f}"
            if integer
            else f"{x:.1f}"
        )

    bound = ">" if stats["lower_bound"] else ""
    return f"{bound}{number(stats['median'])} ({number(stats['min'])}-{number(stats['max'])})"


def table(rows: list[dict]) -> str:
    """The markdown table: one row per workload."""
    header = (
        "| workload | goal | anchor | seeds reached (ours / anchor) "
        "| ours: s with compile | ours: s without | ours: steps "
        "| anchor: s with compile | anchor: s without | anchor: steps "
        "| ratio with compile | ratio without |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---:|---:|"]
    for row in rows:
        ours, anchor = row["ours"], row["anchor"]
        reached = f"{ours['reached']}/{ours['seeds']} / {anchor['reached']}/{anchor['seeds']}"
        lines.append(
            f"| {row['workload']} | {row['goal']} | {row['anchor_name']} | {reached} "
            f"| {cell(ours['wall_seconds'])} | {cell(ours['train_seconds'])} "
            f"| {cell(ours['steps'], True)} | {cell(anchor['wall_seconds'])} "
            f"| {cell(anchor['train_seconds'])} | {cell(anchor['steps'], True)} "
            f"| {row['ratio_wall']} | {row['ratio_train']} |"
        )
    return "\n".join(lines)


def measure(name: str, args: Args, runs_dir: str) -> dict:
    """Every seed of one workload, ours and the anchor one after the other, the first of the
    two alternating from seed to seed."""
    workload = WORKLOADS[name]
    threshold = workload.threshold if args.threshold is None else args.threshold
    runs = {"ours": [], "anchor": []}
    for seed in range(1, args.seeds + 1):
        sides = ["ours", "anchor"] if seed % 2 else ["anchor", "ours"]
        for side in sides:
            if side == "ours":
                result = ours_time(workload, seed, args, runs_dir, threshold)
            else:
                result = anchor_time(workload, seed, args.smoke, threshold)
            runs[side].append({"seed": seed, **result})
            print(f"{name} seed {seed} {side}: {result}", flush=True)
    ours, anchor = summarise(runs["ours"]), summarise(runs["anchor"])
    return {
        "workload": name,
        "goal": workload.goal if args.threshold is None else f"{workload.metric} {threshold}",
        "threshold": threshold,
        "anchor_name": workload.anchor_name,
        "ours": ours,
        "anchor": anchor,
        "ratio_wall": ratio(anchor["wall_seconds"], ours["wall_seconds"]),
        "ratio_train": ratio(anchor["train_seconds"], ours["train_seconds"]),
        "runs": runs,
    }


def main(args: Args) -> dict:
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    split_cpu_host(args.cpu_devices)  # may restart this process
    use_compile_cache(False)  # every seed of both sides compiles from scratch
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "devices": f"{jax.local_device_count()} x {jax.devices()[0].device_kind}",
        "cpu_cores": os.cpu_count(),
        "seeds": args.seeds,
        "smoke": args.smoke,
        "workloads": [],
    }
    with tempfile.TemporaryDirectory() as runs_dir:
        for name in names:
            results["workloads"].append(measure(name, args, runs_dir))
    results["table"] = table(results["workloads"])
    print(results["table"])
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
