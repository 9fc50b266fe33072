"""PPO's memory (--memory gru) and running statistics (--normalize-obs, --normalize-reward):
the GRU's resets and the statistics' merges against plain NumPy, and one real update step
watched from outside: the memory across episode boundaries, whole-sequence minibatches,
normalised observations and scaled rewards. Runs through the driver are in
tests/test_ppo_runs.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import purejaxrl_ppo
from purejaxrl_ppo import ResettingGRU, batch_stats, merge_stats
from tests.helpers import (
    TRUNCATING_ROLLOUTS,
    cartpole_stepped,
    gae_reference,
    train_one_update,
    train_truncating_update,
)
from utils.devices import DEVICE_AXIS
from utils.envs import env_spec
from utils.errors import ConfigError
from utils.trainer import Runtime


def network_of(config):
    return purejaxrl_ppo.make_network(config, env_spec(config.env))


# ---------------------------------------------------------------------------------------------
# Memory (--memory gru)
# ---------------------------------------------------------------------------------------------


def test_gru_memory_starts_again_exactly_where_an_episode_starts():
    """Where a step starts an episode the GRU sees it as the first step of a fresh sequence:
    nothing from before reaches it, the memory it was handed included."""
    gru = ResettingGRU(8)
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(6, 3, 5)).astype(np.float32)
    carry = rng.normal(size=(3, 8)).astype(np.float32)
    starts = np.zeros((6, 3), bool)
    starts[3, 0] = starts[4, 2] = True
    params = gru.init(jax.random.PRNGKey(0), carry, xs, starts)

    def outputs(carry, xs, starts):
        return np.asarray(gru.apply(params, carry, xs, starts)[1])

    out = outputs(carry, xs, starts)
    zeros = np.zeros((1, 8), np.float32)
    np.testing.assert_allclose(
        out[3:, 0], outputs(zeros, xs[3:, :1], starts[3:, :1])[:, 0], atol=1e-6
    )
    np.testing.assert_allclose(
        out[4:, 2], outputs(zeros, xs[4:, 2:], starts[4:, 2:])[:, 0], atol=1e-6
    )
    # env 1 never starts again: it carries the memory it was handed through every step
    assert np.abs(out[:, 1] - outputs(zeros, xs[:, 1:2], starts[:, 1:2])[:, 0]).min() > 1e-4
    # a start at the first step ignores the memory handed in
    first = starts.copy()
    first[0] = True
    np.testing.assert_allclose(outputs(carry, xs, first), outputs(carry * 0, xs, first), atol=1e-6)


@pytest.mark.parametrize("rollout", TRUNCATING_ROLLOUTS)
def test_update_step_resets_memory_where_episodes_start_and_bootstraps_with_it(
    monkeypatch, rollout
):
    """CartPole cut off by a short time limit, with --memory gru. A step-by-step loop replays
    the rollout with the network: an episode starts at the step after every termination or
    truncation (with gymnax's auto-reset, the observation after a done step is already the
    next episode's: PureJaxRL issue 23 reset one step late), and at the first step where the
    state before the rollout says so. The rollout's values and log probabilities, the memory
    it ends with and the targets it learns from all follow, a truncated step bootstrapping from
    its final observation seen with that step's memory; both ways of valuing the truncations
    (during a rollout longer than the time limit, after one that is not)."""
    config, seen = train_truncating_update(
        purejaxrl_ppo, monkeypatch, rollout, memory="gru", hidden_size=16
    )
    traj, params, end = seen["rollout"], seen["start"].params, seen["end"]
    terminated, truncated = traj.terminated > 0, traj.truncated > 0
    done = terminated | truncated
    assert terminated[:-1].any() and (truncated & ~terminated)[:-1].any()
    starts = np.concatenate([seen["start"].starts[None], done[:-1]])
    np.testing.assert_array_equal(traj.start, starts)

    network = network_of(config)
    no_start = np.zeros((1, config.num_envs), bool)

    @jax.jit
    def step(memory, obs):  # the network on one step that continues its episode
        return network.apply(params, memory, obs[None], no_start)

    final_obs = cartpole_stepped(traj.obs, traj.action)  # before any reset
    memory = seen["start"].memory
    values, log_probs, final_values = [], [], []
    for t in range(config.num_steps):
        memory = np.where(starts[t][:, None], 0.0, memory)
        memory, pi, value = step(memory, traj.obs[t])
        values.append(value[0])
        log_probs.append(pi.log_prob(traj.action[t][None])[0])
        final_values.append(step(memory, final_obs[t])[2][0])
    np.testing.assert_allclose(traj.value, np.stack(values), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traj.log_prob, np.stack(log_probs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        traj.final_value, np.where(truncated, np.stack(final_values), 0.0), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(end.memory, memory, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(end.starts, done[-1])
    last_value = step(np.where(done[-1][:, None], 0.0, memory), end.obs)[2][0]
    advantages, targets = gae_reference(
        traj.reward,
        traj.value,
        np.asarray(last_value, np.float64),
        np.asarray(np.stack(final_values), np.float64),
        terminated,
        truncated,
        config.gamma,
        config.gae_lambda,
    )
    np.testing.assert_allclose(seen["advantages"], advantages, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(seen["targets"], targets, rtol=1e-4, atol=1e-5)


def test_minibatches_replay_whole_sequences_from_the_memory_the_rollout_started_with():
    """After 24 updates of learning CartPole, two more at a learning rate of 1e-12: these move
    the policy by nothing, so every minibatch must give back the log probabilities the rollout
    acted with (approx_kl 0, up to rounding). Each minibatch replays its environments' whole
    sequences from the memory they had when the rollout began, shuffled with them. One that
    started from zeros, took another environment's memory or cut sequences would not (the
    trained policy depends on its memory)."""
    config = purejaxrl_ppo.Config(
        num_envs=8,
        num_steps=16,
        num_minibatches=4,
        update_epochs=2,
        total_timesteps=8 * 16 * 26,
        learning_rate=2.5e-3,
        memory="gru",
        hidden_size=16,
    )
    trainer = purejaxrl_ppo.make_train(config)
    on_device = functools.partial(jax.vmap, axis_name=DEVICE_AXIS)  # the device axis, size 1
    train_chunk = jax.jit(on_device(trainer.train_chunk, in_axes=(0, None)), static_argnums=1)
    state = on_device(trainer.init, in_axes=(0, None))(
        jax.random.PRNGKey(0)[None], trainer.hyperparams
    )
    state, learning = train_chunk(state, 24)
    assert np.nanmax(learning["approx_kl"]) > 1e-4  # it learned
    frozen = state.hparams._replace(learning_rate=jnp.full_like(state.hparams.learning_rate, 1e-12))
    _, metrics = train_chunk(state._replace(hparams=frozen), 2)
    assert np.abs(metrics["approx_kl"]).max() < 1e-7, metrics["approx_kl"]
    assert np.all(metrics["clip_frac"] == 0)


def test_memory_needs_whole_environments_per_minibatch():
    config = purejaxrl_ppo.Config(num_envs=6, num_minibatches=4, memory="gru")
    with pytest.raises(
        ConfigError, match="envs per device must be divisible by --num-minibatches 4"
    ):
        purejaxrl_ppo.validate(config, Runtime())


# ---------------------------------------------------------------------------------------------
# Running statistics (--normalize-obs, --normalize-reward)
# ---------------------------------------------------------------------------------------------


def plain_stats(values, prior_count=0.0):
    """Count, mean and variance of all values [N, ...] at once, in float64; `prior_count`
    pseudo-values of mean 0 and variance 1 (the initial statistics) count with them."""
    x = np.asarray(values, np.float64)
    count = prior_count + len(x)
    mean = x.sum(0) / count
    var = (prior_count * (1.0 + mean**2) + ((x - mean) ** 2).sum(0)) / count
    return count, mean, var


def test_merged_statistics_of_uneven_batches_equal_those_of_all_values_at_once():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=(n, 2, 3)).astype(np.float32) for n in (1, 7, 64, 2)]
    one_device = functools.partial(jax.vmap, axis_name=DEVICE_AXIS)
    stats = one_device(batch_stats)(batches[0][None])
    for batch in batches[1:]:
        stats = merge_stats(stats, one_device(batch_stats)(batch[None]))
    count, mean, var = plain_stats(np.concatenate(batches))
    assert float(stats.count[0]) == count
    np.testing.assert_allclose(stats.mean[0], mean, rtol=1e-5)
    np.testing.assert_allclose(stats.var[0], var, rtol=1e-4)


def test_batch_statistics_combine_every_devices_values_and_agree_on_each():
    """Two devices, as the driver's pmap names them (a vmap with the same axis name sums over
    it alike): both get the statistics of all their values together."""
    x = np.random.default_rng(1).normal(size=(2, 5, 3)).astype(np.float32)
    x[1] += 10.0  # the devices' means far apart: their own variances alone would be small
    stats = jax.vmap(batch_stats, axis_name=DEVICE_AXIS)(x)
    count, mean, var = plain_stats(x.reshape(10, 3))
    for device in range(2):
        assert float(stats.count[device]) == count
        np.testing.assert_allclose(stats.mean[device], mean, rtol=1e-5)
        np.testing.assert_allclose(stats.var[device], var, rtol=1e-4)


def test_update_step_normalises_observations_and_rewards_with_the_running_statistics(
    monkeypatch,
):
    """CartPole cut off after 20 steps, with both normalisations. The batches the statistics
    took in are the environments' raw observations (each one CartPole step from the one before
    it, or a reset) and the discounted returns of CartPole's reward 1, restarted with each
    episode. The agent acts on each observation scaled by the statistics of every observation
    so far, itself included (CleanRL's wrapper order), and learns from each reward divided by
    the discounted returns' standard deviation so far. A time limit's bootstrap values the
    observation the episode was cut off in, scaled by the statistics of its step."""
    config = purejaxrl_ppo.Config(
        num_envs=4,
        num_steps=32,
        num_minibatches=2,
        update_epochs=1,
        total_timesteps=128,
        normalize_obs=True,
        normalize_reward=True,
    )
    seen = train_one_update(purejaxrl_ppo, monkeypatch, config, max_steps_in_episode=20)
    traj, steps = seen["rollout"], config.num_steps
    truncated = traj.truncated > 0
    done = (traj.terminated > 0) | truncated
    assert done[:-1].any() and truncated.any()
    network, params = network_of(config), seen["start"].params

    def value(obs):  # the critic's, with the parameters the rollout acted with
        return network.apply(params, obs, method=purejaxrl_ppo.ActorCritic.value)

    raw_obs = [b for b in seen["stats_batches"] if b.ndim == 2]  # the reset's, then each step's
    discounted = [b for b in seen["stats_batches"] if b.ndim == 1]
    assert len(raw_obs) == steps + 1 and len(discounted) == steps
    raw_obs, discounted = np.stack(raw_obs), np.stack(discounted)
    raw_final = cartpole_stepped(raw_obs[:-1], traj.action)
    np.testing.assert_allclose(raw_obs[1:][~done], raw_final[~done], rtol=1e-5, atol=1e-6)
    assert np.abs(raw_obs[0]).max() <= 0.05 and np.abs(raw_obs[1:][done]).max() <= 0.05

    def scaled(x, var, mean=0.0):
        return np.clip((x - mean) / np.sqrt(var + 1e-8), -10, 10)

    prior = 1e-4  # gym's initial count
    expected_return = np.zeros(4)
    for t in range(steps):
        _, mean, var = plain_stats(raw_obs[: t + 1].reshape(-1, 4), prior)
        np.testing.assert_allclose(traj.obs[t], scaled(raw_obs[t], var, mean), rtol=1e-4, atol=1e-4)
        _, mean, var = plain_stats(raw_obs[: t + 2].reshape(-1, 4), prior)
        final_value = value(scaled(raw_final[t], var, mean).astype(np.float32))
        np.testing.assert_allclose(
            traj.final_value[t], np.where(truncated[t], final_value, 0.0), rtol=1e-4, atol=1e-4
        )
        episode_starts = np.ones(4, bool) if t == 0 else done[t - 1]
        expected_return = 1.0 + config.gamma * np.where(episode_starts, 0.0, expected_return)
        np.testing.assert_allclose(discounted[t], expected_return, rtol=1e-5)
        _, _, var = plain_stats(discounted[: t + 1].ravel(), prior)
        np.testing.assert_allclose(traj.reward[t], scaled(1.0, var), rtol=1e-4)
    final = seen["end"].normalizer
    count, mean, var = plain_stats(raw_obs.reshape(-1, 4), prior)
    np.testing.assert_allclose(final.obs.count, count, rtol=1e-6)
    np.testing.assert_allclose(final.obs.mean, mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(final.obs.var, var, rtol=1e-4)
    np.testing.assert_allclose(final.discounted_return, expected_return, rtol=1e-5)
