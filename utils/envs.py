"""Environment factory: short aliases, every env family behind one interface, episode statistics.

Families and their packages: gymnax (classic control, MinAtar, bsuite, misc), Craftax
(`utils/env_craftax.py`), XLand-MiniGrid's single-task MiniGrid envs (`utils/env_gridworld.py`)
and Brax (`utils/env_brax.py`). Every env has gymnax's interface: `reset(key, params) -> (obs,
state)` and `step(key, state, action, params) -> (obs, state, reward, terminated, truncated,
info)` with an automatic reset, `info["final_observation"]` (the observation before that reset)
and, from `EpisodeStatsWrapper`, `info["episode_return"]`, `info["episode_length"]` and
`info["episode_stats"]` (the family's extra per-episode statistics, named by
`EnvSpec.episode_stats`). The names of every family are tables here, so that resolving a name
imports no environment package: `--env CartPole` never imports brax, craftax or xminigrid.

`Breakout` and friends are the MinAtar games as implemented by gymnax (10x10xC images), not
the ALE Atari games.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
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


# Craftax (craftax 1.6.1): the symbolic observations (flat vectors); the pixel versions are
# slower and need a convolutional torso.
CRAFTAX_IDS = ("Craftax-Symbolic-v1", "Craftax-Classic-Symbolic-v1")
CRAFTAX_ALIASES = {
    "Craftax": "Craftax-Symbolic-v1",
    "Craftax-Symbolic": "Craftax-Symbolic-v1",
    "Craftax-Classic": "Craftax-Classic-Symbolic-v1",
    "Craftax-Classic-Symbolic": "Craftax-Classic-Symbolic-v1",
}

# XLand-MiniGrid 0.9.3's single-task MiniGrid envs (xminigrid.registered_environments() less the
# XLand-MiniGrid-R* meta-RL envs, whose rulesets download at run time). Also accepted without
# the "MiniGrid-" prefix (DoorKey-5x5).
XMINIGRID_IDS = (
    "MiniGrid-BlockedUnlockPickUp",
    "MiniGrid-DoorKey-5x5",
    "MiniGrid-DoorKey-6x6",
    "MiniGrid-DoorKey-8x8",
    "MiniGrid-DoorKey-16x16",
    "MiniGrid-Empty-5x5",
    "MiniGrid-Empty-6x6",
    "MiniGrid-Empty-8x8",
    "MiniGrid-Empty-16x16",
    "MiniGrid-EmptyRandom-5x5",
    "MiniGrid-EmptyRandom-6x6",
    "MiniGrid-EmptyRandom-8x8",
    "MiniGrid-EmptyRandom-16x16",
    "MiniGrid-FourRooms",
    "MiniGrid-LockedRoom",
    "MiniGrid-MemoryS8",
    "MiniGrid-MemoryS16",
    "MiniGrid-MemoryS32",
    "MiniGrid-MemoryS64",
    "MiniGrid-MemoryS128",
    "MiniGrid-Playground",
    "MiniGrid-Unlock",
    "MiniGrid-UnlockPickUp",
)
XMINIGRID_ALIASES = {"DoorKey": "MiniGrid-DoorKey-5x5"}

# Brax 0.14.2's envs (brax.envs less its "fast" test env), as `<name>-brax`. Also accepted as
# `brax:<name>`, `<name>` and the CamelCase aliases below.
BRAX_NAMES = (
    "ant",
    "halfcheetah",
    "hopper",
    "humanoid",
    "humanoidstandup",
    "inverted_double_pendulum",
    "inverted_pendulum",
    "pusher",
    "reacher",
    "swimmer",
    "walker2d",
)
BRAX_IDS = tuple(f"{name}-brax" for name in BRAX_NAMES)
BRAX_ALIASES = {
    "HalfCheetah": "halfcheetah-brax",
    "Walker2d": "walker2d-brax",
    "HumanoidStandup": "humanoidstandup-brax",
    "InvertedPendulum": "inverted_pendulum-brax",
    "InvertedDoublePendulum": "inverted_double_pendulum-brax",
}

# Family (preset key) -> (package listed in errors, adapter module, ids, aliases). The adapter
# module, imported on first use, has `make(env_id, max_episode_steps) -> (env, params, spec)`
# (env with an automatic reset, before EpisodeStatsWrapper) and `frame_renderer(env_id)`.
FAMILIES = {
    "craftax": ("craftax", "utils.env_craftax", CRAFTAX_IDS, CRAFTAX_ALIASES),
    "gridworld": ("xminigrid", "utils.env_gridworld", XMINIGRID_IDS, XMINIGRID_ALIASES),
    "brax": ("brax", "utils.env_brax", BRAX_IDS, BRAX_ALIASES),
}


def _family_names() -> dict[str, str]:
    """Every spelling (lower case) of the non-gymnax envs -> env id."""
    names = {}
    for _, _, ids, aliases in FAMILIES.values():
        names.update({env_id.lower(): env_id for env_id in ids})
        names.update({alias.lower(): env_id for alias, env_id in aliases.items()})
    for env_id in XMINIGRID_IDS:
        names[env_id.removeprefix("MiniGrid-").lower()] = env_id
    for name in BRAX_NAMES:
        names[f"brax:{name}"] = names[name] = f"{name}-brax"
    return names


def family_of(env_id: str) -> str | None:
    """'craftax', 'gridworld' or 'brax' for an env id of those families; None for gymnax."""
    return next((f for f, (_, _, ids, _) in FAMILIES.items() if env_id in ids), None)


def family_module(family: str):
    """The adapter module of a non-gymnax family, imported (with its package) on first use."""
    return importlib.import_module(FAMILIES[family][1])


def _gymnax():
    """gymnax, imported on first use: importing it loads every one of its environments and,
    through their renderers, matplotlib and seaborn: a start-up cost that an AlphaZero run never
    needs (measured in docs/benchmarks.md). matplotlib's pyplot and seaborn, which only the
    renderers call, load when one of them first uses them (`_import_lazily`)."""
    _import_lazily("seaborn")
    _import_lazily("matplotlib.pyplot")
    import gymnax

    return gymnax


def _import_lazily(name: str) -> None:
    """Put a stand-in for module `name` in sys.modules that imports the module at its first
    attribute lookup and forwards every lookup to it; nothing changes where `name` is imported
    already or not installed. (The standard library's LazyLoader does not do here: on Python
    3.11 the next `import name` statement already runs the module.)"""
    if name in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a dotted name whose parent package is not installed
        return
    if spec is not None:
        sys.modules[name] = _ModuleOnFirstUse(name, spec)


class _ModuleOnFirstUse(types.ModuleType):
    """`_import_lazily`'s stand-in. It has the module's name and spec, so that `import name`
    takes it as imported; any other attribute imports the module, which then takes the
    stand-in's place in sys.modules."""

    def __init__(self, name: str, spec):
        super().__init__(name)
        self.__spec__ = spec

    def __getattr__(self, attr: str):  # only for attributes the stand-in lacks
        module = self.__dict__.get("_module")
        if module is None:
            if sys.modules.get(self.__name__) is self:
                del sys.modules[self.__name__]
            module = importlib.import_module(self.__name__)
            self.__dict__["_module"] = module
        return getattr(module, attr)


def resolve_env_id(name: str) -> str:
    """Map an alias or id (any case) to the env id, or raise a ConfigError listing every valid
    name by family. Only a gymnax name (or an unknown one) imports gymnax."""
    family_names = _family_names()
    if name.lower() in family_names:
        return family_names[name.lower()]
    gymnax = _gymnax()
    by_lower = {env_id.lower(): env_id for env_id in gymnax.registered_envs}
    by_lower.update({alias.lower(): env_id for alias, env_id in GYMNAX_ALIASES.items()})
    try:
        return by_lower[name.lower()]
    except KeyError:
        groups = [(gymnax.registered_envs, GYMNAX_ALIASES, "gymnax")]
        groups += [(ids, aliases, package) for package, _, ids, aliases in FAMILIES.values()]
        listing = "; ".join(
            f"{package}: {', '.join(ids)} (aliases: "
            f"{', '.join(f'{a} ({i})' for a, i in aliases.items())})"
            for ids, aliases, package in groups
        )
        raise ConfigError(
            f"unknown env {name!r}; valid names by family: {listing}; brax envs also as "
            f"brax:NAME or NAME, MiniGrid ones without 'MiniGrid-'"
        ) from None


def env_family(env_id: str) -> str:
    """Preset family of an env id: 'craftax', 'gridworld', 'brax', or for gymnax ids 'minatar',
    'continuous' or 'classic'."""
    family = family_of(env_id)
    if family is not None:
        return family
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
    # The time limit: `truncated` is set at an episode's max_episode_steps-th step and only
    # there (PPO's rollout relies on it)
    max_episode_steps: int
    # Names of the extra per-episode statistics in info["episode_stats"] (Craftax's achievement
    # rate, ...), averaged over ended episodes by `episode_metrics`
    episode_stats: tuple[str, ...] = ()


class AutoResetEnv:
    """gymnax's automatic reset for an adapter whose `reset_env(key, params) -> (obs, state)`
    and `step_env(key, state, action, params) -> (obs, state, reward, terminated, truncated,
    info)` do not reset: where an episode ends, the returned state and observation are a fresh
    episode's, and `info["final_observation"]` keeps the observation it ended in."""

    def reset(self, key, params):
        return self.reset_env(key, params)

    def step(self, key, state, action, params):
        step_key, reset_key = jax.random.split(key)
        obs, state, reward, terminated, truncated, info = self.step_env(
            step_key, state, action, params
        )
        reset_obs, reset_state = self.reset_env(reset_key, params)
        done = jnp.logical_or(terminated, truncated)
        next_state = jax.tree.map(lambda r, s: jnp.where(done, r, s), reset_state, state)
        next_obs = jnp.where(done, reset_obs, obs)
        info = {**info, "final_observation": obs}
        return next_obs, next_state, reward, terminated, truncated, info


@struct.dataclass
class EpisodeStatsState:
    env_state: Any
    episode_return: jax.Array
    episode_length: jax.Array


# The info keys of an ended episode's statistics, in `episode_metrics`'s argument order.
EPISODE_INFO = ("episode_return", "episode_length", "episode_stats")


class EpisodeStatsWrapper:
    """Tracks undiscounted return and length of the running episode.

    `info["episode_return"]` / `info["episode_length"]` hold the totals of the episode that
    ended at this step and are only meaningful where `terminated | truncated`, as are the
    family's extra statistics in `info["episode_stats"]` ({} for gymnax envs).
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
        info = {
            **info,
            "episode_return": episode_return,
            "episode_length": episode_length,
            "episode_stats": info.get("episode_stats", {}),
        }
        state = EpisodeStatsState(
            env_state,
            jnp.where(done, 0.0, episode_return),
            jnp.where(done, 0, episode_length),
        )
        return obs, state, reward, terminated, truncated, info


def make_env(name: str, max_episode_steps: int | None = None):
    """Build an env with episode statistics: returns (env, env_params, EnvSpec).
    `max_episode_steps` replaces the env's time limit (tests use it to reach a truncation)."""
    env_id = resolve_env_id(name)
    family = family_of(env_id)
    if family is not None:
        env, env_params, spec = family_module(family).make(env_id, max_episode_steps)
        return EpisodeStatsWrapper(env), env_params, spec
    gymnax = _gymnax()
    env, env_params = gymnax.make(env_id)
    if max_episode_steps is not None:
        env_params = env_params.replace(max_steps_in_episode=max_episode_steps)
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


def episode_metrics(
    done, episode_return, episode_length, episode_stats=None
) -> dict[str, jax.Array]:
    """Mean return and length, and mean of each extra statistic in `episode_stats` (a dict of
    arrays shaped like `done`), of the episodes that ended in a batch of steps (any shape), over
    all devices; NaN where none ended. Call it inside the driver's pmap."""
    episodes = device_sum(done.sum())

    def mean_over_episodes(values):
        total = device_sum(jnp.where(done, values, 0).sum())
        return jnp.where(episodes > 0, total / episodes, jnp.nan)

    return {
        "episode_return": mean_over_episodes(episode_return),
        "episode_length": mean_over_episodes(episode_length),
        **{name: mean_over_episodes(v) for name, v in (episode_stats or {}).items()},
        "episodes": episodes,
    }
