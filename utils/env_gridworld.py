"""XLand-MiniGrid's single-task MiniGrid envs (xminigrid 0.9.3) behind the gymnax interface of
`utils/envs.py`.

xminigrid's API is dm_env-like: `env.reset(params, key)` and `env.step(params, timestep,
action)` return a TimeStep, with no automatic reset; `discount == 0` marks a reached goal and a
last step with `discount == 1` the time limit (`params.max_steps`, 10 x width x height for
DoorKey). This adapter keeps the TimeStep as its state, reads `terminated` and `truncated` from
it, and resets by `AutoResetEnv`.

Observation: xminigrid's (7, 7, 2) agent view of tile and colour ids, one-hot encoded into
(7, 7, 13 + 12) floats, so that an MLP (or a convolution) sees categories, not magnitudes.
Reward: 1 - 0.9 x steps / max_steps on reaching the goal, else 0 (MiniGrid's).
Extra per-episode statistic (`info["episode_stats"]`): `success_rate`, 100 where the episode
reached its goal before the time limit, else 0.

(NAVIX, the other JAX MiniGrid, needs Python >= 3.12 from its 0.7.5 on; this project runs 3.11.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from utils.envs import AutoResetEnv, EnvSpec

EPISODE_STATS = ("success_rate",)


class GridworldEnv(AutoResetEnv):
    def __init__(self, env_id: str):
        import xminigrid
        from xminigrid.core.constants import NUM_COLORS, NUM_TILES
        from xminigrid.types import StepType

        self._env, self.default_params = xminigrid.make(env_id)
        self._sizes = (NUM_TILES, NUM_COLORS)
        self._last = StepType.LAST

    def observation(self, grid_view):
        tiles, colors = self._sizes
        return jnp.concatenate(
            [
                jax.nn.one_hot(grid_view[..., 0], tiles, dtype=jnp.float32),
                jax.nn.one_hot(grid_view[..., 1], colors, dtype=jnp.float32),
            ],
            axis=-1,
        )

    def reset_env(self, key, params):
        timestep = self._env.reset(params, key)
        return self.observation(timestep.observation), timestep

    def step_env(self, key, timestep, action, params):
        timestep = self._env.step(params, timestep, action)
        last = timestep.step_type == self._last
        terminated = jnp.logical_and(last, timestep.discount == 0.0)
        truncated = jnp.logical_and(last, ~terminated)
        stats = {"success_rate": terminated.astype(jnp.float32) * 100.0}
        obs = self.observation(timestep.observation)
        return obs, timestep, timestep.reward, terminated, truncated, {"episode_stats": stats}

    def render(self, params, timestep):
        return self._env.render(params, timestep)


def make(env_id: str, max_episode_steps: int | None = None):
    env = GridworldEnv(env_id)
    params = env.default_params
    if max_episode_steps is not None:
        params = params.replace(max_steps=max_episode_steps)
    view = params.view_size
    spec = EnvSpec(
        env_id=env_id,
        obs_shape=(view, view, sum(env._sizes)),
        discrete=True,
        num_actions=int(env._env.num_actions(params)),
        action_low=None,
        action_high=None,
        max_episode_steps=int(params.max_steps),
        episode_stats=EPISODE_STATS,
    )
    return env, params, spec


def frame_renderer(env_id: str):
    """`draw(env, params, state) -> RGB uint8 frame` with xminigrid's renderer (the whole grid,
    the agent's view highlighted), for --capture-video."""
    import numpy as np

    def draw(env, params, state):
        return np.asarray(env.render(params, state)).astype(np.uint8)

    return draw
