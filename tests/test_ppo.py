"""PPO: GAE, truncation bootstrapping, the PPO loss, the action distributions and the running
statistics against plain NumPy; the trainer without the driver, as PureJaxRL's users call it; one
real update step watched from outside (its targets, continuous actions, the GRU's memory across
episode boundaries, normalised observations and rewards). Runs through the driver are in
tests/test_ppo_runs.py."""

import dataclasses
import functools

import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnax.environments.classic_control import cartpole
from scipy import stats

import purejaxrl_ppo
from purejaxrl_ppo import (
    ActorCritic,
    Categorical,
    DiagGaussian,
    HyperParams,
    ResettingGRU,
    Transition,
    batch_stats,
    merge_stats,
    ppo_loss,
    rollout_targets,
)
from tests.golden_runs import GOLDEN_DIR, read_columns
from utils.devices import DEVICE_AXIS
from utils.envs import env_spec
from utils.errors import ConfigError
from utils.trainer import Runtime, TrainerContractError


def gae_reference(rewards, values, last_value, final_values, terminated, truncated, gamma, lam):
    """Textbook GAE, one environment and one step at a time."""
    num_steps, num_envs = rewards.shape
    advantages = np.zeros((num_steps, num_envs))
    for n in range(num_envs):
        next_advantage = 0.0
        for t in reversed(range(num_steps)):
            if terminated[t, n]:
                next_value = 0.0
            elif truncated[t, n]:
                next_value = final_values[t, n]
            elif t + 1 < num_steps:
                next_value = values[t + 1, n]
            else:
                next_value = last_value[n]
            delta = rewards[t, n] + gamma * next_value - values[t, n]
            episode_ended = terminated[t, n] or truncated[t, n]
            next_advantage = delta + (0.0 if episode_ended else gamma * lam * next_advantage)
            advantages[t, n] = next_advantage
    return advantages, advantages + values


def gae(rewards, values, last_value, final_values, terminated, truncated, gamma, lam):
    """The trainer's targets of a rollout with these values, rewards and episode ends."""
    rollout = Transition(*[None] * len(Transition._fields))._replace(
        value=values,
        reward=rewards,
        terminated=terminated.astype(np.float32),
        truncated=truncated.astype(np.float32),
    )
    return rollout_targets(rollout, last_value, final_values, gamma, lam)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_reference_loop(seed):
    rng = np.random.default_rng(seed)
    num_steps, num_envs = 17, 5
    rewards = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    values = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    last_value = rng.normal(size=num_envs).astype(np.float32)
    final_values = rng.normal(size=(num_steps, num_envs)).astype(np.float32)
    terminated = rng.random((num_steps, num_envs)) < 0.15
    truncated = rng.random((num_steps, num_envs)) < 0.15  # some steps are both
    assert (terminated & truncated).any() and (truncated & ~terminated).any()
    expected = gae_reference(
        rewards, values, last_value, final_values, terminated, truncated, 0.99, 0.95
    )
    got = gae(rewards, values, last_value, final_values, terminated, truncated, 0.99, 0.95)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-5)


def test_truncation_bootstraps_from_final_observation_value():
    """A time limit is not a terminal state: the target keeps gamma * V(final observation)."""
    rewards = np.array([[1.0], [1.0]], np.float32)
    values = np.array([[5.0], [7.0]], np.float32)  # step 1 is the first step of a new episode
    final_values = np.array([[10.0], [0.0]], np.float32)
    last_value = np.array([3.0], np.float32)
    no = np.zeros((2, 1), bool)
    truncated = np.array([[True], [False]])
    gamma = 0.9
    _, targets = gae(rewards, values, last_value, final_values, no, truncated, gamma, 1.0)
    assert targets[0, 0] == pytest.approx(1.0 + gamma * 10.0)  # not 1.0 (terminal) nor via 7.0
    assert targets[1, 0] == pytest.approx(1.0 + gamma * 3.0)
    # The same step as a real termination gets no bootstrap at all.
    _, targets = gae(rewards, values, last_value, final_values, truncated, no, gamma, 1.0)
    assert targets[0, 0] == pytest.approx(1.0)


def test_ppo_loss_matches_hand_computation():
    hp = HyperParams(*map(np.float32, [3e-4, 0.99, 0.95, 0.2, 0.01, 0.5, 0.5]))
    log_prob = np.array([-0.5, -1.0, -0.2, -2.0], np.float32)
    old_log_prob = np.array([-0.7, -0.9, -0.6, -1.5], np.float32)
    entropy = np.array([0.6, 0.5, 0.7, 0.4], np.float32)
    value = np.array([1.0, 0.2, -0.5, 2.0], np.float32)
    old_value = np.array([0.8, 0.5, -0.1, 1.0], np.float32)
    advantages = np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    targets = np.array([1.5, 0.0, 0.0, 1.2], np.float32)

    # By hand, in float64.
    ratio = np.exp(log_prob.astype(np.float64) - old_log_prob)
    adv = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    policy_loss = np.mean(
        [max(-a * r, -a * min(max(r, 0.8), 1.2)) for a, r in zip(adv, ratio, strict=True)]
    )
    v_clipped = old_value + np.clip(value - old_value, -0.2, 0.2)
    value_loss = 0.5 * np.mean(np.maximum((value - targets) ** 2, (v_clipped - targets) ** 2))
    expected = policy_loss + 0.5 * value_loss - 0.01 * entropy.mean()

    minibatch = (log_prob, entropy, value, old_log_prob, old_value, advantages, targets)
    loss, info = ppo_loss(*minibatch, hp=hp, norm_adv=True, clip_vloss=True)
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    assert float(info.policy_loss) == pytest.approx(policy_loss, rel=1e-5)
    assert float(info.value_loss) == pytest.approx(value_loss, rel=1e-5)
    assert float(info.clip_frac) == pytest.approx(np.mean(np.abs(ratio - 1) > 0.2))
    assert float(info.approx_kl) == pytest.approx(np.mean(ratio - 1 - np.log(ratio)), rel=1e-4)

    # Without advantage normalisation and value clipping the plain formulas apply.
    loss, info = ppo_loss(*minibatch, hp=hp, norm_adv=False, clip_vloss=False)
    raw_policy = np.mean(np.maximum(-advantages * ratio, -advantages * np.clip(ratio, 0.8, 1.2)))
    assert float(info.policy_loss) == pytest.approx(raw_policy, rel=1e-5)
    assert float(info.value_loss) == pytest.approx(0.5 * np.mean((value - targets) ** 2), rel=1e-5)


def test_categorical_matches_numpy():
    logits = np.array([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]], np.float32)
    pi = Categorical(jnp.asarray(logits))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    action = np.array([1, 2])
    np.testing.assert_allclose(pi.log_prob(action), np.log(probs[[0, 1], action]), rtol=1e-6)
    np.testing.assert_allclose(pi.entropy(), -(probs * np.log(probs)).sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(pi.mode(), [1, 0])


def test_diag_gaussian_matches_scipy():
    mean = np.array([[0.5, -1.0]], np.float32)
    log_std = np.array([[0.0, np.log(2.0)]], np.float32)
    pi = DiagGaussian(jnp.asarray(mean), jnp.asarray(log_std))
    action = np.array([[1.0, 0.0]], np.float32)
    reference = stats.norm(mean, np.exp(log_std))
    np.testing.assert_allclose(pi.log_prob(action), reference.logpdf(action).sum(-1), rtol=1e-5)
    np.testing.assert_allclose(pi.entropy(), reference.entropy().sum(-1), rtol=1e-5)
    samples = pi.sample(jax.random.PRNGKey(0))
    assert samples.shape == mean.shape


# ---------------------------------------------------------------------------------------------
# Without the driver
# ---------------------------------------------------------------------------------------------


def test_make_train_needs_no_driver():
    trainer = purejaxrl_ppo.make_train(purejaxrl_ppo.Config())
    assert trainer.runtime == Runtime() and trainer.num_updates == 976


def test_jit_of_vmap_of_train_runs_two_seeds_without_the_driver():
    """PureJaxRL's usage, on the golden 2-seed PPO CartPole run's settings: the same numbers as
    the driver's run of seeds 1 and 2, up to float32 noise."""
    config = purejaxrl_ppo.Config(
        num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, total_timesteps=512
    )
    train = purejaxrl_ppo.make_train(config).train
    keys = jnp.stack([jax.random.PRNGKey(1), jax.random.PRNGKey(2)])
    state, metrics = jax.jit(jax.vmap(train))(keys)
    assert metrics["episode_return"].shape == (2, 8)
    kernel = state.params["params"]["actor"]["layers_1"]["kernel"]  # [seeds, ...]
    assert kernel.shape[0] == 2 and not np.allclose(kernel[0], kernel[1])
    golden = read_columns(GOLDEN_DIR / "ppo_cartpole_2_seeds.csv")
    for name in ("episode_return", "value_loss", "entropy"):
        recorded = np.array(golden[name], float).reshape(8, 2).T  # rows: update-major
        np.testing.assert_allclose(metrics[name], recorded, rtol=1e-4, err_msg=name)


def test_train_refuses_a_trainer_built_for_several_devices():
    trainer = purejaxrl_ppo.make_train(purejaxrl_ppo.Config(), Runtime(num_devices=2))
    with pytest.raises(TrainerContractError, match="one device"):
        trainer.train(jax.random.PRNGKey(0))


def test_max_grad_norm_0_turns_clipping_off():
    """A zero threshold would clip every gradient to nothing; 0 means no clipping instead."""
    config = purejaxrl_ppo.Config(
        num_envs=4, num_steps=16, num_minibatches=2, update_epochs=1, total_timesteps=128
    )
    key = jax.random.PRNGKey(0)

    def params_moved(max_grad_norm):
        trainer = purejaxrl_ppo.make_train(dataclasses.replace(config, max_grad_norm=max_grad_norm))
        state, _ = jax.jit(trainer.train)(key)
        start = jax.vmap(trainer.init, (0, None), axis_name=DEVICE_AXIS)(
            key[None], trainer.hyperparams
        )
        moved = jax.tree.map(lambda a, b: np.abs(a - b[0]).max(), state.params, start.params)
        return max(jax.tree.leaves(moved))

    assert params_moved(0.0) > 10 * params_moved(1e-6) > 0


# ---------------------------------------------------------------------------------------------
# The update step's own wiring, watched from outside
# ---------------------------------------------------------------------------------------------


def train_one_update(monkeypatch, config, **env_params):
    """One update step of the real trainer, with these gymnax env params replaced, watched from
    outside: its state before and after, the rollout it collected and the advantages and targets
    it learned from (as `rollout_targets` returned them), every action its environments
    received and, in order, every batch its running statistics took in (`batch_stats`, with
    --normalize-obs or --normalize-reward). Leaves without the device axis."""
    seen = {"env_actions": [], "stats_batches": []}
    make_env, targets_of = purejaxrl_ppo.make_env, purejaxrl_ppo.rollout_targets
    stats_of = purejaxrl_ppo.batch_stats

    class ActionRecorder:
        """The environment, recording every action it receives."""

        def __init__(self, env):
            self.env = env

        def __getattr__(self, name):
            return getattr(self.env, name)

        def step(self, key, state, action, params):
            jax.debug.callback(seen["env_actions"].append, action)
            return self.env.step(key, state, action, params)

    def make_watched_env(name):
        env, params, spec = make_env(name)
        return ActionRecorder(env), params.replace(**env_params), spec

    def watched_targets(traj, last_value, final_values, gamma, gae_lambda):
        advantages, targets = targets_of(traj, last_value, final_values, gamma, gae_lambda)
        jax.debug.callback(
            lambda traj, advantages, targets: seen.update(
                rollout=traj, advantages=advantages, targets=targets
            ),
            traj,
            advantages,
            targets,
        )
        return advantages, targets

    def watched_stats(x):
        jax.debug.callback(lambda x: seen["stats_batches"].append(np.asarray(x)), x)
        return stats_of(x)

    monkeypatch.setattr(purejaxrl_ppo, "make_env", make_watched_env)
    monkeypatch.setattr(purejaxrl_ppo, "rollout_targets", watched_targets)
    monkeypatch.setattr(purejaxrl_ppo, "batch_stats", watched_stats)
    trainer = purejaxrl_ppo.make_train(config)
    assert trainer.num_updates == 1
    on_device = functools.partial(jax.vmap, axis_name=DEVICE_AXIS)  # the device axis, size 1
    start = on_device(trainer.init, in_axes=(0, None))(
        jax.random.PRNGKey(0)[None], trainer.hyperparams
    )
    end, _ = jax.jit(on_device(lambda state: trainer.train_chunk(state, 1)))(start)
    jax.effects_barrier()
    assert "rollout" in seen, "the update step no longer calls purejaxrl_ppo.rollout_targets"
    without_device_axis = functools.partial(jax.tree.map, lambda x: np.asarray(x[0]))
    return {**seen, "start": without_device_axis(start), "end": without_device_axis(end)}


def cartpole_stepped(obs, action):
    """CartPole's observations [...] one step of its dynamics on (before any reset)."""
    env, env_params = gymnax.make("CartPole-v1")

    def stepped(obs, action):
        x, x_dot, theta, theta_dot = obs
        state = cartpole.EnvState(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot, time=0)
        return env.step_env(jax.random.PRNGKey(0), state, action, env_params)[0]

    batch_axes = obs.ndim - 1
    for _ in range(batch_axes):
        stepped = jax.vmap(stepped)
    return np.asarray(stepped(obs, action))


def network_of(config):
    return purejaxrl_ppo.make_network(config, env_spec(config.env))


def test_update_step_bootstraps_truncations_from_the_final_observation(monkeypatch):
    """CartPole cut off after 20 steps: the advantages and targets the update step learns from
    are textbook GAE of the rollout it collected, where a truncated step bootstraps from the
    value of its final observation (before the automatic reset), the rollout's last step from
    the value of the observation after it, and a terminated step from nothing."""
    config = purejaxrl_ppo.Config(
        num_envs=4, num_steps=64, num_minibatches=2, update_epochs=1, total_timesteps=256
    )
    seen = train_one_update(monkeypatch, config, max_steps_in_episode=20)
    traj, params = seen["rollout"], seen["start"].params
    terminated, truncated = traj.terminated > 0, traj.truncated > 0
    # Every case occurs: terminations and truncations before the last step, and environments
    # whose episode runs on past the rollout.
    assert terminated[:-1].any() and (truncated & ~terminated)[:-1].any()
    assert not (terminated | truncated)[-1].all()

    # CartPole's observation is its state: the observation each step ended in, before any
    # reset, is one step of its dynamics from the observation acted on.
    final_obs = cartpole_stepped(traj.obs, traj.action)
    np.testing.assert_allclose(traj.final_obs, final_obs, rtol=1e-5, atol=1e-6)

    network = network_of(config)

    def value(obs):
        return np.asarray(network.apply(params, obs, method=ActorCritic.value), np.float64)

    np.testing.assert_allclose(traj.value, value(traj.obs), rtol=1e-5, atol=1e-6)
    advantages, targets = gae_reference(
        traj.reward,
        traj.value,
        value(seen["end"].obs),  # learning leaves the environments where the rollout ended
        value(final_obs),
        terminated,
        truncated,
        config.gamma,
        config.gae_lambda,
    )
    np.testing.assert_allclose(seen["advantages"], advantages, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(seen["targets"], targets, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Continuous actions
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pendulum_update():
    config = purejaxrl_ppo.Config(
        env="Pendulum",
        num_envs=4,
        num_steps=64,
        num_minibatches=2,
        update_epochs=2,
        total_timesteps=256,
        ent_coef=0.0,  # the continuous preset's: log_std learns from the policy loss alone
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        return config, train_one_update(monkeypatch, config)


def test_gaussian_policy_samples_have_the_mean_and_std_the_network_gives(pendulum_update):
    config, seen = pendulum_update
    network = network_of(config)
    obs = seen["rollout"].obs[0, :3]  # three Pendulum states
    params = jax.tree.map(jnp.asarray, seen["start"].params)  # a copy
    # Means well apart (the policy head starts at gain 0.01) and a std other than 1.
    params["params"]["actor"]["layers_5"]["kernel"] *= 100
    params["params"]["log_std"] = jnp.log(jnp.array([0.3]))
    n = 50_000
    pi = network.apply(params, jnp.repeat(obs, n, axis=0), method=ActorCritic.policy)
    samples = np.asarray(pi.sample(jax.random.PRNGKey(2))).reshape(3, n)
    mean = np.asarray(pi.mean).reshape(3, n)[:, 0]
    std = np.exp(np.asarray(pi.log_std).reshape(3, n)[:, 0])
    np.testing.assert_allclose(std, 0.3, rtol=1e-6)
    # Five standard errors: of a mean, std / sqrt(n); of a normal sample's std, std / sqrt(2n).
    mean_error, std_error = 5 * 0.3 / np.sqrt(n), 5 * 0.3 / np.sqrt(2 * n)
    assert np.ptp(mean) > 20 * mean_error
    np.testing.assert_allclose(samples.mean(1), mean, rtol=0, atol=mean_error)
    np.testing.assert_allclose(samples.std(1), std, rtol=0, atol=std_error)


def test_continuous_actions_are_clipped_for_the_env_only(pendulum_update):
    """Pendulum's torque bounds are [-2, 2]: the environments receive the sampled actions
    clipped to them, while the rollout keeps the sample and the log probability of it."""
    config, seen = pendulum_update
    traj = seen["rollout"]
    assert (np.abs(traj.action) > 2).any()  # the Gaussian (std 1 at first) samples beyond them
    received = np.sort(np.concatenate([np.ravel(a) for a in seen["env_actions"]]))
    np.testing.assert_array_equal(received, np.sort(np.clip(traj.action, -2, 2).ravel()))
    pi = network_of(config).apply(seen["start"].params, traj.obs, method=ActorCritic.policy)
    log_prob = stats.norm(pi.mean, np.exp(pi.log_std)).logpdf(traj.action).sum(-1)
    np.testing.assert_allclose(traj.log_prob, log_prob, rtol=1e-5, atol=1e-5)


def test_log_std_is_one_learned_parameter_for_every_state_starting_at_0(pendulum_update):
    config, seen = pendulum_update
    start, end = seen["start"].params, seen["end"].params
    np.testing.assert_array_equal(start["params"]["log_std"], np.zeros(1))
    # The update moved it (Adam's first steps are about the learning rate each)...
    learned = end["params"]["log_std"]
    assert np.abs(learned).min() > 0.1 * config.learning_rate
    # ... and the policy's log std is that parameter in every state.
    pi = network_of(config).apply(end, seen["rollout"].obs, method=ActorCritic.policy)
    np.testing.assert_array_equal(pi.log_std, np.broadcast_to(learned, pi.log_std.shape))


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


def test_update_step_resets_memory_where_episodes_start_and_bootstraps_with_it(monkeypatch):
    """CartPole cut off after 20 steps, with --memory gru. A step-by-step loop replays the
    rollout with the network: an episode starts at the first step and at the step after every
    termination or truncation (with gymnax's auto-reset, the observation after a done step is
    already the next episode's: PureJaxRL issue 23 reset one step late). The rollout's values
    and log probabilities, the memory it ends with and the targets it learns from all follow,
    a truncated step bootstrapping from its final observation seen with that step's memory."""
    config = purejaxrl_ppo.Config(
        num_envs=4,
        num_steps=64,
        num_minibatches=2,
        update_epochs=1,
        total_timesteps=256,
        memory="gru",
        hidden_size=16,
    )
    seen = train_one_update(monkeypatch, config, max_steps_in_episode=20)
    traj, params, end = seen["rollout"], seen["start"].params, seen["end"]
    terminated, truncated = traj.terminated > 0, traj.truncated > 0
    done = terminated | truncated
    assert terminated[:-1].any() and (truncated & ~terminated)[:-1].any()
    starts = np.concatenate([np.ones((1, 4), bool), done[:-1]])
    np.testing.assert_array_equal(traj.start, starts)

    network = network_of(config)
    no_start = np.zeros((1, 4), bool)

    def step(memory, obs):  # the network on one step that continues its episode
        return network.apply(params, memory, obs[None], no_start)

    memory = np.full((4, 16), np.nan, np.float32)  # never read: the first step starts episodes
    values, log_probs, final_values = [], [], []
    for t in range(config.num_steps):
        memory = np.where(starts[t][:, None], 0.0, memory)
        memory, pi, value = step(memory, traj.obs[t])
        values.append(value[0])
        log_probs.append(pi.log_prob(traj.action[t][None])[0])
        final_values.append(step(memory, traj.final_obs[t])[2][0])
    np.testing.assert_allclose(traj.value, np.stack(values), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(traj.log_prob, np.stack(log_probs), rtol=1e-5, atol=1e-5)
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
    the discounted returns' standard deviation so far."""
    config = purejaxrl_ppo.Config(
        num_envs=4,
        num_steps=32,
        num_minibatches=2,
        update_epochs=1,
        total_timesteps=128,
        normalize_obs=True,
        normalize_reward=True,
    )
    seen = train_one_update(monkeypatch, config, max_steps_in_episode=20)
    traj, steps = seen["rollout"], config.num_steps
    done = (traj.terminated > 0) | (traj.truncated > 0)
    assert done[:-1].any()
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
        np.testing.assert_allclose(
            traj.final_obs[t], scaled(raw_final[t], var, mean), rtol=1e-4, atol=1e-4
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
