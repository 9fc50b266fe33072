"""Craftax (craftax 1.6.1) behind the gymnax interface of `utils/envs.py`.

craftax 1.6.1 speaks gymnax's old 5-value API (`obs, state, reward, done, info`), where `done`
joins the time limit (`state.timestep >= params.max_timesteps`) with the terminal states (death,
lava, the defeated boss). This adapter steps craftax's env without its automatic reset, splits
`done` into `terminated` (terminal even without a time limit) and `truncated` (the time limit
alone), and resets by `AutoResetEnv`.

Extra per-episode statistics (`info["episode_stats"]`, percentages):
- `achievement_rate`: the share of Craftax's achievements (22 in Classic, 67 in Craftax)
  unlocked in the episode; averaged over episodes it is the mean of the per-achievement success
  rates.
- `score`: craftax's own per-episode score (`craftax_classic/envs/common.py`), the geometric
  mean over achievements of 1 + 100 x unlocked, minus 1, as Craftax's baselines log it.
"""

from __future__ import annotations

import jax.numpy as jnp

from utils.envs import AutoResetEnv, EnvSpec

EPISODE_STATS = ("achievement_rate", "score")


class CraftaxEnv(AutoResetEnv):
    def __init__(self, env_id: str):
        from craftax.craftax_env import make_craftax_env_from_name

        self.env_id = env_id
        self._env = make_craftax_env_from_name(env_id, auto_reset=False)
        self.default_params = self._env.default_params

    def reset_env(self, key, params):
        return self._env.reset_env(key, params)

    def step_env(self, key, state, action, params):
        obs, state, reward, done, _ = self._env.step_env(key, state, action, params)
        no_time_limit = params.replace(max_timesteps=jnp.iinfo(jnp.int32).max)
        terminated = self._env.is_terminal(state, no_time_limit)
        truncated = jnp.logical_and(done, ~terminated)
        unlocked = state.achievements.astype(jnp.float32) * 100.0
        stats = {
            "achievement_rate": unlocked.mean(),
            "score": jnp.exp(jnp.mean(jnp.log(1.0 + unlocked))) - 1.0,
        }
        return obs, state, reward, terminated, truncated, {"episode_stats": stats}


def make(env_id: str, max_episode_steps: int | None = None):
    env = CraftaxEnv(env_id)
    params = env.default_params
    if max_episode_steps is not None:
        params = params.replace(max_timesteps=max_episode_steps)
    spec = EnvSpec(
        env_id=env_id,
        obs_shape=tuple(env._env.observation_space(params).shape),
        discrete=True,
        num_actions=int(env._env.action_space(params).n),
        action_low=None,
        action_high=None,
        max_episode_steps=int(params.max_timesteps),
        episode_stats=EPISODE_STATS,
    )
    return env, params, spec


def frame_renderer(env_id: str):
    """`draw(env, params, state) -> RGB uint8 frame` with craftax's pixel renderer (its small
    agent-view textures), for --capture-video."""
    import jax
    import numpy as np

    if "Classic" in env_id:
        from craftax.craftax_classic.constants import BLOCK_PIXEL_SIZE_IMG
        from craftax.craftax_classic.renderer import make_craftax_pixel_renderer
    else:
        from craftax.craftax.constants import BLOCK_PIXEL_SIZE_IMG
        from craftax.craftax.renderer import make_craftax_pixel_renderer
    render = jax.jit(make_craftax_pixel_renderer(BLOCK_PIXEL_SIZE_IMG))

    def draw(env, params, state):
        return np.asarray(render(state)).clip(0, 255).astype(np.uint8)

    return draw
