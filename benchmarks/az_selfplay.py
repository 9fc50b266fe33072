"""AlphaZero throughput, ours next to the pgx AlphaZero example's, in one process.

    python benchmarks/az_selfplay.py                      # tic_tac_toe x 256, connect_four x 128
    python benchmarks/az_selfplay.py --cpu-devices 2      # the host split into 2 XLA devices
    python benchmarks/az_selfplay.py --games othello:64 --iterations 10

The example is pgx's examples/alphazero/train.py (rebuilt in benchmarks/references.py) with its
configuration scaled down: its ResNet v2 (BatchNorm, 2 blocks x 32 channels, XLA
convolutions), 32 simulations of Gumbel MuZero, `auto_reset` games, pmapped over the local
devices. It is measured two ways, moves/s with compilation excluded:
- its self-play step alone: one jitted call of `--rollout-steps` moves, returning the
  positions, search policies and rewards the example trains on;
- its whole iteration, as its loop runs one: that self-play, the value targets, the positions
  fetched to the host and shuffled, and one epoch of SGD in batches of 4 positions per game
  (the example's 4,096 for 1,024 games), each step's losses read back.

Ours is `purejaxrl_az.py` at the game's preset with the same network size, simulations and
number of games, training on each position about once as the example does, through the normal
driver: its moves/s also pay for the replay buffer, metrics, checkpoints and the in-loop
evaluation every `--eval-every` iterations, which the example does not have. They are timed
over its chunks after the first, as the example's calls after a warm-up call (the JSON file
also has the whole run's), so `--iterations` must be at least twice `--eval-every`.

The three alternate for `--rounds` rounds per game, so that a machine's drifting speed hits
each. Every compilation starts from scratch, as in a fresh process: no persistent compilation
cache, and JAX's in-memory caches cleared first (the example's whole iteration would otherwise
reuse the self-play program compiled just before it).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pgx
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_az
from benchmarks.references import (
    AZ_ON_CPU,
    ReferenceAlphaZero,
    ReferenceNet,
    reference_selfplay,
)
from utils.cli import parse_config
from utils.devices import split_cpu_host, use_compile_cache
from utils.driver import run_training
from utils.logs import write_json


@dataclasses.dataclass
class Args:
    games: tuple[str, ...] = ("tic_tac_toe:256", "connect_four:128")
    """game:number of games played side by side"""
    iterations: int = 20
    """iterations of our trainer per game: at least twice its --eval-every, as its moves/s are
    timed after its first chunk (a multiple of --eval-every includes its evaluations)"""
    rounds: int = 2
    """times each of the three sides runs per game, alternating"""
    rollout_steps: int = 32
    """moves per game in one call of the example's self-play, and in one of its iterations"""
    num_simulations: int = 32
    """MCTS simulations per move, both implementations"""
    cpu_devices: int = 0
    """split the CPU into this many XLA devices first (0: JAX's default)"""
    extra: str = ""
    """extra flags for our trainer, e.g. tiny sizes for a smoke test"""
    out: str | None = None
    """also write the results to this JSON file"""


def median_seconds(call: Callable[[], Any]) -> float:
    """The median wall time of three calls of `call` after a warm-up call, each timed until
    what it returns is computed."""
    jax.block_until_ready(call())
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - start)
    return sorted(times)[1]


def compile_reference(game: str, num_games: int, steps: int, simulations: int):
    """The pgx example's self-play step, compiled: (a function that times it and returns
    moves/s, compile seconds)."""
    env = pgx.make(game)
    devices = jax.local_device_count()
    games_per_device = num_games // devices
    net = ReferenceNet(env.num_actions)
    example = jax.vmap(env.init)(jax.random.split(jax.random.PRNGKey(0), games_per_device))
    variables = net.init(jax.random.PRNGKey(0), example.observation)
    selfplay = reference_selfplay(env, net, games_per_device, steps, simulations)

    replicated = jax.tree.map(lambda x: jnp.stack([x] * devices), variables)
    keys = jax.random.split(jax.random.PRNGKey(1), devices)
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.pmap(selfplay).lower(replicated, keys).compile()
    compile_seconds = time.perf_counter() - start

    def moves_per_second() -> float:
        return (
            games_per_device * devices * steps / median_seconds(lambda: compiled(replicated, keys))
        )

    return moves_per_second, compile_seconds


def compile_whole_iteration(game: str, num_games: int, steps: int, simulations: int):
    """The pgx example's whole iteration, compiled: (a function that times it and returns
    moves/s, compile seconds)."""
    settings = AZ_ON_CPU._replace(
        selfplay_batch_size=num_games,
        max_num_steps=steps,
        training_batch_size=4 * num_games,
        num_simulations=simulations,
    )
    example = ReferenceAlphaZero(game, settings)
    init_key, compile_key, key = jax.random.split(jax.random.PRNGKey(2), 3)
    variables, opt_state = example.init(init_key)
    jax.clear_caches()
    start = time.perf_counter()
    example.compile(variables, opt_state, compile_key)
    compile_seconds = time.perf_counter() - start

    def one_iteration():
        """The next iteration, training on from the last one."""
        nonlocal variables, opt_state, key
        key, iteration_key = jax.random.split(key)
        variables, opt_state = example.iterate(variables, opt_state, iteration_key)
        return variables

    def moves_per_second() -> float:
        return example.moves_per_iteration / median_seconds(one_iteration)

    return moves_per_second, compile_seconds


def ours_moves_per_second(args: Args, game: str, num_games: str, runs_dir: str):
    """(moves/s, the whole run's moves/s, compile s) of one `purejaxrl_az.py` run through the
    driver. The first is timed over the chunks after the first, as the example's calls are
    timed after a warm-up call: during the first chunk the in-loop evaluation's program
    compiles on the same cores (utils/driver.py), which slows that chunk's training."""
    cli = ["--env", game, "--num-games", num_games, "--runs-dir", runs_dir]
    cli += ["--num-iterations", str(args.iterations), "--no-progress"]
    cli += ["--num-simulations", str(args.num_simulations), "--no-compile-cache"]
    cli += ["--cpu-devices", str(args.cpu_devices), *args.extra.split()]

    config = parse_config(
        purejaxrl_az.Config, purejaxrl_az.PRESETS, cli, preset_key=purejaxrl_az.resolve_game
    )
    # As many positions per iteration as it plays, as the example trains (--extra's sizes
    # included).
    updates = max(1, config.num_games * config.rollout_steps // config.minibatch_size)
    config = dataclasses.replace(config, updates_per_iteration=updates)
    jax.clear_caches()
    summary = run_training(config, purejaxrl_az.make_train, purejaxrl_az.validate)
    if len(summary["chunk_ends"]) < 2:
        sys.exit(
            "ours trained in one chunk: give --iterations at least twice its --eval-every, so"
            " that its moves/s are timed after its first chunk"
        )
    first, last = summary["chunk_ends"][0], summary["chunk_ends"][-1]
    moves_per_update = summary["env_steps_per_seed"] // summary["num_updates"]
    moves = (last["update"] - first["update"]) * moves_per_update
    seconds = last["train_seconds"] - first["train_seconds"]
    return moves / seconds, summary["steps_per_second"], summary["compile_seconds"]


def main(args: Args) -> list[dict]:
    split_cpu_host(args.cpu_devices)
    use_compile_cache(False)  # every side compiles from scratch
    results = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for entry in args.games:
            game, num_games = entry.split(":")
            sizes = (game, int(num_games), args.rollout_steps, args.num_simulations)
            reference, reference_compile = compile_reference(*sizes)
            whole, whole_compile = compile_whole_iteration(*sizes)
            reference_runs, whole_runs, our_runs = [], [], []
            for _ in range(args.rounds):
                reference_runs.append(reference())
                whole_runs.append(whole())
                our_runs.append(ours_moves_per_second(args, game, num_games, runs_dir))
            ours = [moves for moves, _, _ in our_runs]
            results.append(
                {
                    "game": game,
                    "num_games": int(num_games),
                    "devices": f"{jax.local_device_count()} x {jax.devices()[0].device_kind}",
                    "reference_moves_per_second": [round(m) for m in reference_runs],
                    "reference_compile_seconds": round(reference_compile, 2),
                    "whole_iteration_moves_per_second": [round(m) for m in whole_runs],
                    "whole_iteration_compile_seconds": round(whole_compile, 2),
                    "ours_moves_per_second": [round(m) for m in ours],
                    "ours_whole_run_moves_per_second": [round(run[1]) for run in our_runs],
                    "ours_compile_seconds": round(our_runs[0][2], 2),  # the first round's
                    "ratio": round(float(np.median(ours) / np.median(reference_runs)), 3),
                    "ratio_to_whole_iteration": round(
                        float(np.median(ours) / np.median(whole_runs)), 3
                    ),
                }
            )
    print(
        "| game | games | devices | example's self-play moves/s | example's whole iteration "
        "moves/s | ours moves/s | ours over self-play, over whole iteration | compile s "
        "(self-play / whole iteration / ours) |"
    )
    print("|---|---:|---|---|---|---|---|---|")
    for r in results:
        rounds = [
            " / ".join(f"{m:,}" for m in r[f"{side}_moves_per_second"])
            for side in ("reference", "whole_iteration", "ours")
        ]
        compiles = [
            r[f"{side}_compile_seconds"] for side in ("reference", "whole_iteration", "ours")
        ]
        print(
            f"| {r['game']} | {r['num_games']} | {r['devices']} | {' | '.join(rounds)} | "
            f"{r['ratio']}, {r['ratio_to_whole_iteration']} | {' / '.join(map(str, compiles))} |"
        )
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
