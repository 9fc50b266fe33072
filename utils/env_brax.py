"""Brax (brax 0.14.2) continuous control behind the gymnax interface of `utils/envs.py`.

Why Brax and this backend: MuJoCo Playground's robot envs clone a model repository at run time,
which fails offline, while Brax's envs ship with the package and install beside jax 0.10.2
(Brax's README calls them unmaintained since 0.13; they still run unchanged). Brax's default
backend is MJX, which ran at 49 steps/s on CPU; of its own JAX pipelines, "positional"
(position-based dynamics) is the one PureJaxRL's continuous PPO trains on, so its returns are
comparable, at 22k hopper steps/s on 2 CPU cores inside one jitted scan. "spring" is 2.3x faster
(51k) with the least accurate contacts, "generalized" 4x slower (6k). Change BACKEND to trade.

Episodes are cut at 1000 steps (`truncated`, Brax's and Gymnasium's limit); `terminated` is the
env's own `done` (a hopper or walker that fell). Actions lie in [-1, 1]^d. Reset by
`AutoResetEnv` with a fresh random start, not Brax's AutoResetWrapper, which replays the first
start of each env. No renderer: Brax draws with MuJoCo's OpenGL renderer or as HTML that loads
three.js from the internet.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct

from utils.envs import AutoResetEnv, EnvSpec

BACKEND = "positional"
EPISODE_LENGTH = 1000


@struct.dataclass
class BraxState:
    pipeline: object  # brax.envs.State
    steps: jnp.ndarray  # int32 steps into the episode


class BraxEnv(AutoResetEnv):
    def __init__(self, name: str, episode_length: int):
        import contextlib
        import io
        import warnings

        # mujoco.mjx prints "Failed to import warp" (an optional GPU kernel package) on import
        with contextlib.redirect_stdout(io.StringIO()):
            from brax import envs

        with warnings.catch_warnings():  # "Brax System, pipelines and environments are not
            warnings.simplefilter("ignore", UserWarning)  # actively being maintained": above
            self._env = envs.get_environment(name, backend=BACKEND)
        self.episode_length = episode_length

    def reset_env(self, key, params):
        state = self._env.reset(key)
        return state.obs, BraxState(state, jnp.int32(0))

    def step_env(self, key, state, action, params):
        pipeline = self._env.step(state.pipeline, action)
        steps = state.steps + 1
        terminated = pipeline.done > 0
        truncated = jnp.logical_and(steps >= self.episode_length, ~terminated)
        return pipeline.obs, BraxState(pipeline, steps), pipeline.reward, terminated, truncated, {}


def make(env_id: str, max_episode_steps: int | None = None):
    episode_length = EPISODE_LENGTH if max_episode_steps is None else max_episode_steps
    env = BraxEnv(env_id.removesuffix("-brax"), episode_length)
    action_size = env._env.action_size
    spec = EnvSpec(
        env_id=env_id,
        obs_shape=(int(env._env.observation_size),),
        discrete=False,
        num_actions=int(action_size),
        action_low=-jnp.ones(action_size, jnp.float32),
        action_high=jnp.ones(action_size, jnp.float32),
        max_episode_steps=episode_length,
    )
    return env, None, spec


def frame_renderer(env_id: str):
    """None: no renderer that works offline and without a display (see the module's notes)."""
    return None
