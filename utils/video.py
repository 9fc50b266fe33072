"""Episode animations: one greedy episode rolled out inside jit, drawn by gymnax's renderer or
by the env family's own (Craftax's and xminigrid's pixel renderers; Brax has none offline).

Rendering is host work (matplotlib, and pygame for the classic-control envs), so it runs once
after training and never inside the compiled loop.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from utils.evaluation import Policy

# The envs gymnax's Visualizer can draw (gymnax/visualize/visualizer.py).
RENDERABLE_ENVS = frozenset(
    {
        "Acrobot-v1",
        "CartPole-v1",
        "Pendulum-v1",
        "MountainCar-v0",
        "MountainCarContinuous-v0",
        "Catch-bsuite",
        "Asterix-MinAtar",
        "Breakout-MinAtar",
        "Freeway-MinAtar",
        "Seaquest-MinAtar",
        "SpaceInvaders-MinAtar",
        "PointRobot-misc",
        "MetaMaze-misc",
        "FourRooms-misc",
    }
)


# Frames of a family's renderer at most: a Craftax episode can last 10,000 steps.
MAX_FRAMES = 1000


def rollout_states(env, env_params, policy: Policy, key, max_steps: int | None = None):
    """One episode of `policy` in a plain gymnax env (or any env of its interface, given
    `max_steps`): the env states it passed through (a list, first state first) and its
    return."""
    max_steps = max_steps or int(env_params.max_steps_in_episode)

    def _step(carry, step_key):
        obs, state, memory, done, total = carry
        action, memory = policy.act(obs[None], memory)
        obs, next_state, reward, terminated, truncated, _ = env.step(
            step_key, state, action[0], env_params
        )
        total = total + jax.numpy.where(done, 0.0, reward)
        return (obs, next_state, memory, done | terminated | truncated, total), (state, done)

    @jax.jit
    def episode(key):
        reset_key, key = jax.random.split(key)
        obs, state = env.reset(reset_key, env_params)
        memory = policy.initial_memory(1)
        carry = (obs, state, memory, jax.numpy.bool_(False), jax.numpy.float32(0.0))
        (*_, total), (states, done_before) = jax.lax.scan(
            _step, carry, jax.random.split(key, max_steps)
        )
        return states, done_before, total

    states, done_before, total = jax.device_get(episode(key))
    length = int(np.argmax(done_before)) if done_before.any() else max_steps
    return [jax.tree.map(lambda x, t=t: x[t], states) for t in range(length)], float(total)


def write_episode_gif(env_id: str, policy: Policy, key, path: str) -> str | None:
    """Write one greedy episode as a GIF at `path`; returns the path, or None (and prints one
    line) when there is no renderer for the env."""
    from utils.envs import env_family, family_of, resolve_env_id

    env_id = resolve_env_id(env_id)
    if family_of(env_id) is not None:
        return _write_family_gif(env_id, env_family(env_id), policy, key, path)
    if env_id not in RENDERABLE_ENVS:
        print(f"--capture-video: gymnax has no renderer for {env_id}; no video written")
        return None
    import gymnax  # with its matplotlib renderers: imported only when a video is asked for
    from gymnax.visualize import Visualizer

    # pygame draws the classic-control envs off screen, without a display or sound card.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    os.environ.setdefault("SDL_AUDIODRIVER", "dummy")
    env, env_params = gymnax.make(env_id)
    states, _ = rollout_states(env, env_params, policy, key)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.gif"
    Visualizer(env, env_params, states).animate(tmp)
    os.replace(tmp, path)
    return path


def _write_family_gif(env_id: str, family: str, policy: Policy, key, path: str) -> str | None:
    """write_episode_gif for the non-gymnax families: the first MAX_FRAMES states of one
    episode, drawn by the family's `frame_renderer`."""
    from PIL import Image

    from utils.envs import family_module, make_env

    draw = family_module(family).frame_renderer(env_id)
    if draw is None:
        print(f"--capture-video: {family} has no offline renderer for {env_id}; no video written")
        return None
    env, env_params, spec = make_env(env_id)
    states, _ = rollout_states(
        env, env_params, policy, key, min(spec.max_episode_steps, MAX_FRAMES)
    )
    frames = [Image.fromarray(draw(env._env, env_params, s.env_state)) for s in states]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp.gif"
    frames[0].save(tmp, save_all=True, append_images=frames[1:], duration=50, loop=0)
    os.replace(tmp, path)
    return path
