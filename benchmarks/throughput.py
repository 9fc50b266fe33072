"""Training throughput next to the raw environment limit, in one process.

    python benchmarks/throughput.py            # PPO and DQN on CartPole, PPO on Breakout-MinAtar
    python benchmarks/throughput.py --runs dqn:Breakout:1000000 "ppo:Acrobot:500000:--num-envs 8"
    python benchmarks/throughput.py --families  # PPO on Craftax-Classic, DoorKey-5x5 and Hopper

For each run (algo:env:env_steps[:extra flags]) the trainer runs at the env's preset through the
normal driver (progress bar, metrics.csv and checkpoints at their default frequency), one seed
unless the flags say otherwise. Its env steps per second, all seeds and sweep configurations
together, exclude compilation. The limit is the same batch of environments (times the runs)
stepped by a uniform-random policy inside one jitted scan: what the hardware does with no
learning at all. Name Brax envs without "brax:" here (Hopper): the colon separates the fields.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_dqn
import purejaxrl_ppo
from utils.cli import parse_config
from utils.driver import run_training
from utils.envs import make_env
from utils.logs import write_json
from utils.sweep import num_configs

TRAINERS = {"ppo": purejaxrl_ppo, "dqn": purejaxrl_dqn}


@dataclasses.dataclass
class Args:
    runs: tuple[str, ...] = (
        "ppo:CartPole:500000",
        "ppo:Breakout:2000000:--learning-rate 5e-3 --ent-coef 0.01",  # PureJaxRL's settings
        "ppo:Breakout:2000000",
        "dqn:CartPole:500000",
        "ppo:CartPole:500000:--num-seeds 12",
        "ppo:CartPole:500000:--num-seeds 4 --sweep lr=2.5e-4,1e-3,1e-4",
    )
    """algo:env:env_steps[:extra flags], each at the env's preset plus the extra flags"""
    families: bool = False
    """run FAMILY_RUNS instead: PPO at the preset of each env family beyond gymnax"""
    progress: bool = True
    """keep the progress bar on, as a user would"""
    out: str | None = None
    """also write the results to this JSON file"""


# The env families beyond gymnax, at their PPO presets (Craftax's whole preset would take an
# hour on a 2-core CPU).
FAMILY_RUNS = (
    "ppo:Craftax-Classic:1000000",
    "ppo:DoorKey:1000000",
    "ppo:Hopper:1000000",
)


def random_action(spec, key, num_envs: int):
    """A uniform-random action for each of `num_envs` envs of this EnvSpec."""
    if spec.discrete:
        return jax.random.randint(key, (num_envs,), 0, spec.num_actions)
    shape = (num_envs, spec.num_actions)
    return jax.random.uniform(key, shape, minval=spec.action_low, maxval=spec.action_high)


def random_policy_steps_per_second(env_name: str, num_envs: int, num_steps: int) -> float:
    """Env steps/s of `num_envs` environments under a random policy, in one jitted scan."""
    env, env_params, spec = make_env(env_name)

    def rollout(key):
        reset_key, key = jax.random.split(key)
        _, state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, num_envs), env_params
        )

        def _step(carry, _):
            state, key, total = carry
            key, action_key, step_key = jax.random.split(key, 3)
            action = random_action(spec, action_key, num_envs)
            _, state, reward, *_ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
                jax.random.split(step_key, num_envs), state, action, env_params
            )
            return (state, key, total + reward.sum()), None

        (_, _, total), _ = jax.lax.scan(_step, (state, key, jnp.float32(0)), None, num_steps)
        return total

    compiled = jax.jit(rollout).lower(jax.random.PRNGKey(0)).compile()
    jax.block_until_ready(compiled(jax.random.PRNGKey(1)))  # warm-up
    start = time.perf_counter()
    jax.block_until_ready(compiled(jax.random.PRNGKey(2)))
    return num_envs * num_steps / (time.perf_counter() - start)


def main(args: Args) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as runs_dir:
        for run in FAMILY_RUNS if args.families else args.runs:
            algo, env_name, budget, *extra = run.split(":", 3)
            trainer = TRAINERS[algo]
            cli = ["--env", env_name, "--total-timesteps", budget, "--runs-dir", runs_dir]
            cli += extra[0].split() if extra else []
            cli += ["--eval-episodes", "0"] + ([] if args.progress else ["--no-progress"])
            config = parse_config(trainer.Config, trainer.PRESETS, cli)
            summary = run_training(config, trainer.make_train, trainer.validate)
            # every run (seed x sweep configuration) steps its own batch of environments
            num_runs = config.num_seeds * num_configs(config.sweep)
            limit = random_policy_steps_per_second(
                env_name,
                config.num_envs * num_runs,
                summary["env_steps_per_seed"] // config.num_envs,
            )
            results.append(
                {
                    "algo": algo,
                    "env_id": summary["env_id"],
                    "extra_flags": extra[0] if extra else "",
                    "num_envs": config.num_envs,
                    "runs": num_runs,
                    "env_steps": summary["env_steps_per_seed"],
                    "train_steps_per_second": round(summary["steps_per_second"]),
                    "compile_seconds": round(summary["compile_seconds"], 2),
                    "random_policy_steps_per_second": round(limit),
                    "ratio_to_random_policy": round(summary["steps_per_second"] / limit, 3),
                    "final": summary["final_mean"],
                    "devices": f"{jax.local_device_count()} x {jax.devices()[0].device_kind}",
                }
            )
    print("| algo | env | flags | train steps/s | compile s | random-policy steps/s | ratio |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['algo']} | {r['env_id']} | {r['extra_flags'] or 'preset'} | "
            f"{r['train_steps_per_second']:,} | "
            f"{r['compile_seconds']} | {r['random_policy_steps_per_second']:,} | "
            f"{r['ratio_to_random_policy']} |"
        )
    if args.out:
        write_json(args.out, results)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
