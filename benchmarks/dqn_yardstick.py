"""DQN training throughput, ours next to PureJaxRL's dqn.py loop, in one process.

    python benchmarks/dqn_yardstick.py                   # CartPole, 5e5 steps, 2 rounds
    python benchmarks/dqn_yardstick.py --total-timesteps 100000 --rounds 1

The reference is PureJaxRL's dqn.py training loop at its CartPole configuration, rebuilt here
from its published description: 10 environments stepped once per scan iteration, a flashbax
flat buffer of 10k transitions, a 120-84 MLP, one Adam step on 128 sampled transitions per
iteration (its training interval of 10 env steps) once 10k steps are in, plain 1-step targets
from the target network copied every 500 steps, epsilon 1 -> 0.05 over 2.5e5 steps, and no
logging callback. gymnax 1.0's `terminated or truncated` is its `done`. It runs twice: as JAX
runs it by default, which is how its users get it, and with the threefry lowering our driver
switches on (utils/devices.py), which shows how much of the difference is that switch.

Ours is `purejaxrl_dqn.py` through the normal driver (metrics.csv, checkpoints and chunking
as in any run), at its preset (a 128-128 network, 3-step Double-DQN targets, gradient clipping)
and at PureJaxRL's settings (`--hidden-sizes 120 84 --n-step 1 --no-double-dqn --max-grad-norm
0`). They alternate for `--rounds` rounds, so that a machine's drifting speed hits all of them;
env steps/s exclude compilation.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
from typing import NamedTuple

import flashbax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_dqn
from utils.cli import parse_config
from utils.devices import unroll_threefry_on_cpu
from utils.driver import run_training
from utils.envs import make_env
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


# PureJaxRL's dqn.py CartPole configuration
NUM_ENVS = 10
BUFFER_SIZE = 10_000
BATCH_SIZE = 128
EPSILON_START, EPSILON_FINISH, EPSILON_ANNEAL_TIME = 1.0, 0.05, 250_000
TARGET_UPDATE_INTERVAL = 500
LEARNING_RATE = 2.5e-4
LEARNING_STARTS = 10_000
TRAINING_INTERVAL = 10
GAMMA = 0.99


class ReferenceQNetwork(nn.Module):
    num_actions: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(120)(x))
        x = nn.relu(nn.Dense(84)(x))
        return nn.Dense(self.num_actions)(x)


class Step(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array


def reference_train(env_name: str, total_timesteps: int):
    """PureJaxRL's DQN loop as one jittable function of a key -> (final carry, per-iteration
    loss and mean episode return)."""
    env, env_params, spec = make_env(env_name)
    network = ReferenceQNetwork(spec.num_actions)
    optimizer = optax.adam(LEARNING_RATE)
    buffer = flashbax.make_flat_buffer(
        max_length=BUFFER_SIZE,
        min_length=BATCH_SIZE,
        sample_batch_size=BATCH_SIZE,
        add_sequences=False,
        add_batch_size=NUM_ENVS,
    )

    def step_envs(key, state, action):
        obs, state, reward, terminated, truncated, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(key, NUM_ENVS), state, action, env_params)
        return obs, state, reward, jnp.logical_or(terminated, truncated), info

    def train(key):
        key, reset_key, init_key = jax.random.split(key, 3)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, NUM_ENVS), env_params
        )
        params = network.init(init_key, obs)
        example = Step(obs[0], jnp.int32(0), jnp.float32(0), jnp.bool_(False))
        carry = (params, params, optimizer.init(params), buffer.init(example), env_state, obs)
        carry = (*carry, jnp.int32(0), key)

        def _update_step(carry, _):
            params, target_params, opt_state, buffer_state, env_state, last_obs, t, key = carry
            key, explore_key, choice_key, step_key, sample_key = jax.random.split(key, 5)
            q = network.apply(params, last_obs)
            epsilon = jnp.clip(
                (EPSILON_FINISH - EPSILON_START) / EPSILON_ANNEAL_TIME * t + EPSILON_START,
                EPSILON_FINISH,
            )
            random_action = jax.random.randint(choice_key, (NUM_ENVS,), 0, spec.num_actions)
            explore = jax.random.uniform(explore_key, (NUM_ENVS,)) < epsilon
            action = jnp.where(explore, random_action, q.argmax(-1))
            obs, env_state, reward, done, info = step_envs(step_key, env_state, action)
            t = t + NUM_ENVS
            buffer_state = buffer.add(buffer_state, Step(last_obs, action, reward, done))

            def _learn(params, opt_state):
                batch = buffer.sample(buffer_state, sample_key).experience
                next_q = network.apply(target_params, batch.second.obs).max(-1)
                target = batch.first.reward + (1 - batch.first.done) * GAMMA * next_q

                def _loss(params):
                    q = network.apply(params, batch.first.obs)
                    chosen = jnp.take_along_axis(q, batch.first.action[:, None], -1)[:, 0]
                    return jnp.mean((chosen - target) ** 2)

                loss, grads = jax.value_and_grad(_loss)(params)
                updates, opt_state = optimizer.update(grads, opt_state)
                return optax.apply_updates(params, updates), opt_state, loss

            learn_now = (
                buffer.can_sample(buffer_state)
                & (t > LEARNING_STARTS)
                & (t % TRAINING_INTERVAL == 0)
            )
            params, opt_state, loss = jax.lax.cond(
                learn_now, _learn, lambda p, o: (p, o, jnp.float32(0)), params, opt_state
            )
            target_params = jax.lax.cond(
                t % TARGET_UPDATE_INTERVAL == 0, lambda: params, lambda: target_params
            )
            metrics = {"loss": loss, "returns": info["episode_return"].mean()}
            carry = (params, target_params, opt_state, buffer_state, env_state, obs, t, key)
            return carry, metrics

        return jax.lax.scan(_update_step, carry, None, total_timesteps // NUM_ENVS)

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
            *("--hidden-sizes", "120", "84", "--n-step", "1", "--no-double-dqn"),
            *("--max-grad-norm", "0"),
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
