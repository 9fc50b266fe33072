"""The env wrapper's episode statistics and their reduction into per-update metrics; the
lazy imports behind gymnax."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

from utils.devices import DEVICE_AXIS
from utils.envs import _import_lazily, episode_metrics, make_env
from utils.evaluation import evaluate_policy, memoryless


def test_episode_stats_match_a_step_by_step_tally():
    env, env_params, _ = make_env("CartPole")
    _, state = env.reset(jax.random.PRNGKey(0), env_params)
    running_return, finished = 0.0, []
    for t in range(200):  # always pushing left ends CartPole episodes after ~10 steps
        _, state, reward, terminated, truncated, info = env.step(
            jax.random.PRNGKey(t + 1), state, 0, env_params
        )
        running_return += float(reward)
        if terminated or truncated:
            assert float(info["episode_return"]) == running_return
            assert int(info["episode_length"]) == running_return  # reward 1 per step
            finished.append(running_return)
            running_return = 0.0
    assert len(finished) > 5


def test_episode_metrics_average_only_the_episodes_that_ended():
    done = np.array([[True, False], [False, False], [True, True]])
    returns = np.array([[10.0, 99.0], [99.0, 99.0], [20.0, 30.0]], np.float32)
    lengths = np.array([[5, 99], [99, 99], [7, 9]], np.int32)
    reduce = jax.pmap(episode_metrics, axis_name=DEVICE_AXIS)
    metrics = reduce(done[None], returns[None], lengths[None])
    assert float(metrics["episode_return"][0]) == 20.0
    assert float(metrics["episode_length"][0]) == 7.0
    assert int(metrics["episodes"][0]) == 3
    none = reduce(jnp.zeros((1, 3, 2), bool), returns[None], lengths[None])
    assert np.isnan(none["episode_return"][0]) and np.isnan(none["episode_length"][0])


def test_evaluate_policy_returns_each_episodes_undiscounted_return():
    """Against a step-by-step loop over the same keys: each episode's return, and nothing from
    the steps after it ended."""
    env, env_params, spec = make_env("CartPole")

    def policy(obs):  # a deterministic policy that ends episodes at different lengths
        return (obs[:, 2] > 0).astype(jnp.int32)

    key = jax.random.PRNGKey(3)
    returns = evaluate_policy(env, env_params, memoryless(policy), key, 4, spec.max_episode_steps)
    reset_key, step_key = jax.random.split(key)
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(reset_key, 4), env_params)
    expected, finished = np.zeros(4), np.zeros(4, bool)
    while not finished.all():
        step_key, subkey = jax.random.split(step_key)
        obs, state, reward, terminated, truncated, _ = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            jax.random.split(subkey, 4), state, policy(obs), env_params
        )
        expected += np.where(finished, 0.0, np.asarray(reward))
        finished |= np.asarray(terminated | truncated)
    np.testing.assert_array_equal(returns, expected)
    assert len(set(expected.tolist())) > 1


def test_import_lazily_defers_an_installed_module_and_skips_a_missing_one(monkeypatch):
    """An installed module that is not imported yet gets a stand-in that imports it at its
    first use; a module that is not installed, also under a missing parent package (as
    matplotlib.pyplot without matplotlib), is left alone."""
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    _import_lazily("colorsys")
    stand_in = sys.modules["colorsys"]
    assert "_module" not in stand_in.__dict__  # nothing imported yet
    assert stand_in.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert sys.modules["colorsys"] is not stand_in  # the module took the stand-in's place
    for name in ("no_such_package", "no_such_package.pyplot"):
        _import_lazily(name)
        assert name not in sys.modules
