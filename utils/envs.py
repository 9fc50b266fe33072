"""Environment factory: short aliases, gymnax behind one interface, episode statistics.

`Breakout` and friends are the MinAtar games as implemented by gymnax (10x10xC images), not
the ALE Atari games.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from utils.devices import device_sum
from utils.errors import ConfigError

# Short name -> gymnax id. Lookup is case-insensitive; full gymnax ids are accepted as well.
GYMNAX_ALIASES = {
    "CartPole": "CartPole-v1",
    "Acrobot": "Acrobot-v1",
    "MountainCar": "MountainCar-v0",
    "MountainCarContinuous": "MountainCarContinuous-v0",
    "Pendulum": "Pendulum-v1",
    "Asterix": "Asterix-MinAtar",
    "Breakout": "Breakout-MinAtar",
    "Freeway": "Freeway-MinAtar",
    "Seaquest": "Seaquest-MinAtar",
    "SpaceInvaders": "SpaceInvaders-MinAtar",
    "Catch": "Catch-bsuite",
    "DeepSea": "DeepSea-bsuite",
    "FourRooms": "FourRooms-misc",
}


def _gymnax():
    """gymnax, imported on first use: importing it loads every one of its environments and,
    through their renderers, matplotlib and seaborn: a start-up cost that an AlphaZero run never
    needs (measured in docs/benchmarks.md)."""
    import gymnax

    return gymnax


def resolve_env_id(name: str) -> str:
    """Map an alias or gymnax id (any case) to the gymnax id, or raise a ConfigError listing all."""
    gymnax = _gymnax()
    by_lower = {env_id.lower(): env_id for env_id in gymnax.registered_envs}
    by_lower.update({alias.lower(): env_id for alias, env_id in GYMNAX_ALIASES.items()})
    try:
        return by_lower[name.lower()]
    except KeyError:
        aliases = ", ".join(f"{a} ({i})" for a, i in GYMNAX_ALIASES.items())
        raise ConfigError(
            f"unknown env {name!r}; valid aliases: {aliases}; "
            f"valid gymnax ids: {', '.join(gymnax.registered_envs)}"
        ) from None


def env_family(env_id: str) -> str:
    """Preset family of a gymnax id: 'minatar', 'continuous' or 'classic'."""
    if env_id.endswith("-MinAtar"):
        return "minatar"
    gymnax = _gymnax()
    env, env_params = gymnax.make(env_id)
    if isinstance(env.action_space(env_params), gymnax.environments.spaces.Box):
        return "continuous"
    return "classic"


class EnvSpec(NamedTuple):
    """What a trainer needs to know to build its network and sample actions."""

    env_id: str
    obs_shape: tuple[int, ...]
    discrete: bool
    num_actions: int  # discrete: number of actions; continuous: action dimension
    action_low: Any  # continuous only: bounds to clip sampled actions to
    action_high: Any
    max_episode_steps: int


@struct.dataclass
class EpisodeStatsState:
    env_state: Any
    episode_return: jax.Array
    episode_length: jax.Array


class EpisodeStatsWrapper:
    """Tracks undiscounted return and length of the running episode.

    `info["episode_return"]` / `info["episode_length"]` hold the totals of the episode that
    ended at this step and are only meaningful where `terminated | truncated`.
    """

    def __init__(self, env):
        self._env = env

    def __getattr__(self, name):
        return getattr(self._env, name)

    def reset(self, key, params):
        obs, env_state = self._env.reset(key, params)
        return obs, EpisodeStatsState(env_state, jnp.float32(0.0), jnp.int32(0))

    def step(self, key, state, action, params):
        obs, env_state, reward, terminated, truncated, info = self._env.step(
            key, state.env_state, action, params
        )
        done = jnp.logical_or(terminated, truncated)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        info = {**info, "episode_return": episode_return, "episode_length": episode_length}
        state = EpisodeStatsState(
            env_state,
            jnp.where(done, 0.0, episode_return),
            jnp.where(done, 0, episode_length),
        )
        return obs, state, reward, terminated, truncated, info


def make_env(name: str):
    """Build a gymnax env with episode statistics: returns (env, env_params, EnvSpec)."""
    env_id = resolve_env_id(name)
    gymnax = _gymnax()
    env, env_params = gymnax.make(env_id)
    action_space = env.action_space(env_params)
    discrete = isinstance(action_space, gymnax.environments.spaces.Discrete)
    spec = EnvSpec(
        env_id=env_id,
        obs_shape=tuple(env.observation_space(env_params).shape),
        discrete=discrete,
        num_actions=int(action_space.n) if discrete else int(action_space.shape[0]),
        action_low=None if discrete else jnp.asarray(action_space.low, jnp.float32),
        action_high=None if discrete else jnp.asarray(action_space.high, jnp.float32),
        max_episode_steps=int(env_params.max_steps_in_episode),
    )
    return EpisodeStatsWrapper(env), env_params, spec


def env_spec(name: str) -> EnvSpec:
    """The EnvSpec of an env, for checks that need no environment to step."""
    return make_env(name)[2]


def episode_metrics(done, episode_return, episode_length) -> dict[str, jax.Array]:
    """Mean return and length of the episodes that ended in a batch of steps (any shape), over
    all devices; NaN where none ended. Call it inside the driver's pmap."""
    episodes = device_sum(done.sum())
    return_sum = device_sum(jnp.where(done, episode_return, 0.0).sum())
    length_sum = device_sum(jnp.where(done, episode_length, 0).sum())
    return {
        "episode_return": jnp.where(episodes > 0, return_sum / episodes, jnp.nan),
        "episode_length": jnp.where(episodes > 0, length_sum / episodes, jnp.nan),
        "episodes": episodes,
    }
