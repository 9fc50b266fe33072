"""DQN training throughput, ours next to PureJaxRL's dqn.py loop, in one process.

    python benchmarks/dqn_yardstick.py                   # CartPole, 5e5 steps, 2 rounds
    python benchmarks/dqn_yardstick.py --total-timesteps 100000 --rounds 1

The reference is PureJaxRL's dqn.py training loop at its CartPole configuration, rebuilt in
benchmarks/references.py from its published description: 10 environments stepped once per scan iteration, a flashbax
flat buffer of 10k transitions, a 120-84 MLP, one Adam step on 128 sampled transitions per
iteration (its training interval of 10 env steps) once 10k steps are in, plain 1-step targets
from the target network copied every 500 steps, epsilon 1 -> 0.05 over 2.5e5 steps, and no
logging callback (each update sums the returns of the episodes that ended in it). gymnax 1.0's `terminated or truncated` is its `done`. It runs twice: as JAX
runs it by default, which is how its users get it, and with the threefry lowering our driver
switches on (utils/devices.py), which shows how much of the difference is that switch.

Ours is `purejaxrl_dqn.py` through the normal driver (metrics.csv, checkpoints and chunking
as in any run), at its preset (20 envs, a 64-64 network, 3-step Double-DQN targets, gradient
clipping) and at PureJaxRL's settings (`--num-envs 10 --learning-rate 2.5e-4 --hidden-sizes 120
84 --n-step 1 --no-double-dqn --max-grad-norm 0`). They alternate for `--rounds` rounds, so that a machine's drifting speed hits all of them;
env steps/s exclude compilation.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import jax
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_dqn
from benchmarks.references import reference_dqn
from utils.cli import parse_config
from utils.devices import unroll_threefry_on_cpu
from utils.driver import run_training
from utils.logs import write_json


@dataclasses.dataclass
class Args:
    env: str = "CartPole"
    """gymnax env with vector observations and discrete actions"""
    total_timesteps: int = 500_000
    """env steps of every run"""
    rounds: int = 2
    """times the reference and our two settings each run, alternating"""
    out: str | None = None
    """also write the results to this JSON file"""


def reference_train(env_name: str, total_timesteps: int):
    """PureJaxRL's DQN loop as one jittable function of a key -> (final carry, per-update
    metrics), its whole run one scan as in dqn.py."""
    loop = reference_dqn(env_name, total_timesteps)

    def train(key):
        return jax.lax.scan(loop.update, loop.init(key), None, loop.num_updates)

    return train


def reference_steps_per_second(
    env_name: str, total_timesteps: int, unrolled_threefry: bool
) -> tuple[float, float]:
    """(env steps/s, compile seconds) of one reference run, its random numbers lowered the way
    JAX does on CPU by default or, like ours, unrolled (utils/devices.py)."""
    unroll_threefry_on_cpu(unrolled_threefry)
    train = jax.jit(reference_train(env_name, total_timesteps))
    start = time.perf_counter()
    compiled = train.lower(jax.random.PRNGKey(0)).compile()
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(jax.random.PRNGKey(0)))
    return total_timesteps / (time.perf_counter() - start), compile_seconds


def ours_steps_per_second(args: Args, runs_dir: str, extra: list[str]) -> tuple[float, float]:
    cli = ["--env", args.env, "--total-timesteps", str(args.total_timesteps), *extra]
    cli += ["--runs-dir", runs_dir, "--eval-episodes", "0", "--no-progress"]
    config = parse_config(purejaxrl_dqn.Config, purejaxrl_dqn.PRESETS, cli)
    summary = run_training(config, purejaxrl_dqn.make_train, purejaxrl_dqn.validate)
    return summary["steps_per_second"], summary["compile_seconds"]


def main(args: Args) -> list[dict]:
    settings = {
        "PureJaxRL dqn.py loop": False,
        "PureJaxRL dqn.py loop, unrolled threefry": True,
        "purejaxrl_dqn.py preset": [],
        "purejaxrl_dqn.py at PureJaxRL's settings": [
            *("--num-envs", "10", "--learning-rate", "2.5e-4", "--hidden-sizes", "120", "84"),
            *("--n-step", "1", "--no-double-dqn", "--max-grad-norm", "0"),
        ],
    }
    measured = {name: [] for name in settings}
    with tempfile.TemporaryDirectory() as runs_dir:
        for _ in range(args.rounds):
            for name, extra in settings.items():
                if isinstance(extra, bool):
                    result = reference_steps_per_second(args.env, args.total_timesteps, extra)
                else:
                    result = ours_steps_per_second(args, runs_dir, extra)
                measured[name].append(result)
    reference = np.median([sps for sps, _ in measured["PureJaxRL dqn.py loop"]])
    results = [
        {
            "setting": name,
            "env": args.env,
            "total_timesteps": args.total_timesteps,
            "steps_per_second": [round(sps) for sps, _ in runs],
            "compile_seconds": [round(c, 2) for _, c in runs],
            "ratio_to_reference": round(float(np.median([s for s, _ in runs]) / reference), 3),
            "devices": f"{jax.local_device_count()} x {jax.devices()[0].device_kind}",
        }
        for name, runs in measured.items()
    ]
    print("| setting | env steps/s (each round) | compile s | ratio to PureJaxRL's loop |")
    print("|---|---|---|---:|")
    for r in results:
        steps = " / ".join(f"{s:,}" for s in r["steps_per_second"])
        compiles = " / ".join(str(c) for c in r["compile_seconds"])
        print(f"| {r['setting']} | {steps} | {compiles} | {r['ratio_to_reference']} |")
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
