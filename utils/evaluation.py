"""Evaluation rollouts that run inside jit, and the policies they play."""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class Policy(NamedTuple):
    """A deterministic policy, with a memory if it has one (a recurrent network's carry).

    `act(obs, memory) -> (action, memory)` acts on a batch of observations [B, ...];
    `initial_memory(B)` is the memory of B episodes that start together. A policy without
    memory keeps `()` (see `memoryless`).
    """

    act: Callable[[jax.Array, Any], tuple[jax.Array, Any]]
    initial_memory: Callable[[int], Any]


def memoryless(act: Callable[[jax.Array], jax.Array]) -> Policy:
    """The Policy of a function from an observation batch to an action batch."""
    return Policy(lambda obs, memory: (act(obs), memory), lambda batch_size: ())


def evaluate_policy(env, env_params, policy: Policy, key, num_episodes: int, max_steps: int):
    """Return the undiscounted return of `num_episodes` episodes played by `policy`.

    The episodes run side by side, one environment each, until every one of them has ended
    (or `max_steps` have passed, which gymnax's own time limit makes unreachable). Each
    environment plays one episode, so the policy's memory starts once and is never reset.
    The policy is deterministic or takes its randomness from its closure. A `lax.while_loop`
    stops as soon as the last episode ends.
    """
    reset_key, step_key = jax.random.split(key)
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(
        jax.random.split(reset_key, num_episodes), env_params
    )
    returns = jnp.zeros(num_episodes, jnp.float32)
    finished = jnp.zeros(num_episodes, bool)

    def _not_all_finished(carry):
        *_, finished, t = carry
        return jnp.logical_and(~jnp.all(finished), t < max_steps)

    def _step(carry):
        obs, state, memory, key, returns, finished, t = carry
        key, subkey = jax.random.split(key)
        action, memory = policy.act(obs, memory)
        obs, state, reward, terminated, truncated, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(subkey, num_episodes), state, action, env_params
        )
        returns = returns + jnp.where(finished, 0.0, reward)
        finished = finished | terminated | truncated
        return obs, state, memory, key, returns, finished, t + 1

    memory = policy.initial_memory(num_episodes)
    carry = (obs, state, memory, step_key, returns, finished, jnp.int32(0))
    return jax.lax.while_loop(_not_all_finished, _step, carry)[4]
