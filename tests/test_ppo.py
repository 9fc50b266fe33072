"""PPO: GAE, truncation bootstrapping, the PPO loss and the action distributions against plain
NumPy; the trainer without the driver, as PureJaxRL's users call it; whole updates against
PureJaxRL's PPO from the same state; one real update step watched from outside (its targets,
continuous actions). Memory and normalisation are in
tests/test_ppo_memory.py, runs through the driver in tests/test_ppo_runs.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import purejaxrl_ppo
from benchmarks.references import PPO_CARTPOLE, reference_ppo
from purejaxrl_ppo import (
    ActorCritic,
    Categorical,
    DiagGaussian,
    HyperParams,
    Transition,
    ppo_loss,
    rollout_targets,
)
from tests.golden_runs import GOLDEN_DIR, read_columns
from tests.helpers import (
    TRUNCATING_ROLLOUTS,
    cartpole_stepped,
    gae_reference,
    train_one_update,
    train_truncating_update,
)
from utils.devices import DEVICE_AXIS
from utils.envs import env_spec
from utils.trainer import Runtime, TrainerContractError


def gae(rewards, values, last_value, final_values, terminated, truncated, gamma, lam):
    """The trainer's targets of a rollout with these values, rewards and episode ends."""
    rollout = Transition(*[None] * len(Transition._fields))._replace(
        value=values,
        reward=rewards,
        terminated=terminated.astype(np.float32),
        truncated=truncated.astype(np.float32),
        final_value=final_values,
    )
    return rollout_targets(rollout, last_value, gamma, lam)


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
        num_envs=4,
        num_steps=16,
        num_minibatches=2,
        update_epochs=2,
        total_timesteps=512,
        learning_rate=2.5e-4,
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
    """A zero threshold would clip every gradient to nothing; 0 means no clipping instead. Both
    values train side by side in one program, as --sweep max_grad_norm=0,1e-6 would."""
    config = purejaxrl_ppo.Config(
        num_envs=4, num_steps=16, num_minibatches=2, update_epochs=1, total_timesteps=128
    )
    trainer = purejaxrl_ppo.make_train(config)
    max_grad_norms = np.array([0.0, 1e-6], np.float32)
    hyperparams = jax.tree.map(lambda x: np.stack([x, x]), trainer.hyperparams)
    hyperparams = hyperparams._replace(max_grad_norm=max_grad_norms)

    def params_moved(key, hp):
        start = trainer.init(key, hp)
        state, _ = trainer.train_chunk(start, trainer.num_updates)
        moved = jax.tree.map(lambda a, b: jnp.abs(a - b).max(), state.params, start.params)
        return jnp.max(jnp.stack(jax.tree.leaves(moved)))

    over_configs = jax.vmap(params_moved, in_axes=(None, 0))
    on_device = jax.vmap(over_configs, in_axes=(0, None), axis_name=DEVICE_AXIS)  # size 1
    unclipped, clipped = jax.jit(on_device)(jax.random.PRNGKey(0)[None], hyperparams)[0]
    assert unclipped > 10 * clipped > 0


# ---------------------------------------------------------------------------------------------
# The update step's own wiring, watched from outside
# ---------------------------------------------------------------------------------------------


def network_of(config):
    return purejaxrl_ppo.make_network(config, env_spec(config.env))


def test_updates_equal_purejaxrl_reference_updates_from_the_same_state():
    """The whole update step (rollout, GAE, epochs of shuffled minibatches, clipped loss, Adam)
    against PureJaxRL's PPO as benchmarks/references.py rebuilds it, both started from one
    state (parameters, environments, key) at ppo.py's CartPole settings: they draw the same
    random numbers and must end every update with the same parameters. The learning rate is
    constant here, since ours anneals at every optimiser step and PureJaxRL once per update."""
    settings = PPO_CARTPOLE._replace(total_timesteps=PPO_CARTPOLE.total_timesteps * 10**6)
    loop = reference_ppo("CartPole", settings)  # ~1e9 updates: a constant rate in float32
    s = PPO_CARTPOLE
    config = purejaxrl_ppo.Config(
        num_envs=s.num_envs,
        num_steps=s.num_steps,
        learning_rate=s.learning_rate,
        anneal_lr=False,
        total_timesteps=3 * s.num_envs * s.num_steps,
    )
    assert (config.num_minibatches, config.update_epochs, config.activation) == (4, 4, "tanh")
    trainer = purejaxrl_ppo.make_train(config)
    on_device = functools.partial(jax.vmap, axis_name=DEVICE_AXIS)  # the device axis, size 1
    state = on_device(trainer.init, in_axes=(0, None))(
        jax.random.PRNGKey(7)[None], trainer.hyperparams
    )
    ours_update = jax.jit(on_device(lambda state: trainer.train_chunk(state, 1)))
    anchor_update = jax.jit(loop.update)

    def as_reference(params):
        """Our actor and critic layers under the names of PureJaxRL's network."""
        layers = params["params"]
        names = [(net, f"layers_{i}") for net in ("actor", "critic") for i in (1, 3, 5)]
        return {"params": {f"Dense_{k}": layers[net][i] for k, (net, i) in enumerate(names)}}

    first = jax.tree.map(lambda x: x[0], state)
    _, reference_opt_state, *_ = loop.init(jax.random.PRNGKey(0))  # zero Adam moments
    carry = (as_reference(first.params), reference_opt_state, first.env_state, first.obs, first.key)
    for _ in range(3):
        state, metrics = ours_update(state)
        carry, reference_metrics = anchor_update(carry, None)
        ours = jax.tree.map(lambda x: x[0], state)
        np.testing.assert_array_equal(ours.key, carry[4])  # the same random numbers drawn
        np.testing.assert_array_equal(ours.obs, carry[3])  # the same episodes played
        np.testing.assert_allclose(
            np.nansum(metrics["episode_return"] * metrics["episodes"]),
            reference_metrics["return_sum"],
            rtol=1e-6,
        )
        jax.tree.map(
            functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6),
            as_reference(ours.params),
            carry[0],
        )


@pytest.mark.parametrize("rollout", TRUNCATING_ROLLOUTS)
def test_update_step_bootstraps_truncations_from_the_final_observation(monkeypatch, rollout):
    """CartPole cut off by a short time limit: the advantages and targets the update step
    learns from are textbook GAE of the rollout it collected, where a truncated step
    bootstraps from the value of its final observation (before the automatic reset), the
    rollout's last step from the value of the observation after it, and a terminated step
    from nothing. Both ways of valuing the truncations: during a rollout longer than the time
    limit, after one that is not (its rollout starts in the middle of episodes, so that they
    are cut off before its last step)."""
    config, seen = train_truncating_update(purejaxrl_ppo, monkeypatch, rollout)
    traj, params = seen["rollout"], seen["start"].params
    terminated, truncated = traj.terminated > 0, traj.truncated > 0
    # Every case occurs: terminations and truncations before the last step, and environments
    # whose episode runs on past the rollout.
    assert terminated[:-1].any() and (truncated & ~terminated)[:-1].any()
    assert not (terminated | truncated)[-1].all()

    network = network_of(config)

    def value(obs):
        return np.asarray(network.apply(params, obs, method=ActorCritic.value), np.float64)

    np.testing.assert_allclose(traj.value, value(traj.obs), rtol=1e-5, atol=1e-6)
    # CartPole's observation is its state: the observation each step ended in, before any
    # reset, is one step of its dynamics from the observation acted on. The rollout keeps the
    # value of that observation where a time limit cut the episode off, and 0.0 elsewhere.
    final_obs = cartpole_stepped(traj.obs, traj.action)
    np.testing.assert_allclose(
        traj.final_value, np.where(truncated, value(final_obs), 0.0), rtol=1e-5, atol=1e-6
    )
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


@pytest.mark.parametrize("shared_torso", [False, True])
def test_rollout_keeps_image_observations_flattened(monkeypatch, shared_torso):
    """Breakout-MinAtar's observations [10, 10, 4] are kept [T, E, 400] by the rollout (a TPU
    pads small trailing dimensions, docs/benchmarks.md): the flattened observations acted on,
    whose critic values are those of the env-shaped ones. With separate networks and with a
    shared torso."""
    config = purejaxrl_ppo.Config(
        env="Breakout",
        num_envs=4,
        num_steps=8,
        num_minibatches=2,
        total_timesteps=32,
        shared_torso=shared_torso,
    )
    seen = train_one_update(purejaxrl_ppo, monkeypatch, config)
    traj, start = seen["rollout"], seen["start"]
    assert traj.obs.shape == (8, 4, 400)
    np.testing.assert_array_equal(traj.obs[0], np.reshape(start.obs, (4, 400)))
    env_shaped = np.reshape(traj.obs, (8, 4, 10, 10, 4))
    value = network_of(config).apply(start.params, env_shaped, method=ActorCritic.value)
    np.testing.assert_allclose(traj.value, value, rtol=1e-5, atol=1e-6)


def test_a_shared_torso_is_one_first_layer_that_both_heads_train():
    """--shared-torso: actor and critic read one flattening and first hidden layer (on Breakout
    the [400, 64] kernel, held once), then a hidden layer and a head each. The network gives
    the same policy and value together as one at a time, and the gradients of the policy
    alone and of the value alone both reach the shared layer."""
    obs = jax.random.bernoulli(jax.random.PRNGKey(0), 0.2, (5, 10, 10, 4)).astype(jnp.float32)
    network = network_of(purejaxrl_ppo.Config(env="Breakout", shared_torso=True))
    params = network.init(jax.random.PRNGKey(1), obs)
    shapes = jax.tree.map(np.shape, params["params"])
    assert shapes["shared"]["layers_1"]["kernel"] == (400, 64)
    for head, outputs in (("actor", 3), ("critic", 1)):
        assert shapes[head]["layers_0"]["kernel"] == (64, 64)
        assert shapes[head]["layers_2"]["kernel"] == (64, outputs)
    separate = network_of(purejaxrl_ppo.Config(env="Breakout"))
    separate_size = sum(x.size for x in jax.tree.leaves(separate.init(jax.random.PRNGKey(1), obs)))
    assert sum(x.size for x in jax.tree.leaves(params)) == separate_size - (400 * 64 + 64)

    pi, value = network.apply(params, obs)
    policy = network.apply(params, obs, method=ActorCritic.policy)
    np.testing.assert_array_equal(pi.logits, policy.logits)
    np.testing.assert_array_equal(value, network.apply(params, obs, method=ActorCritic.value))

    def entropy(p):
        return network.apply(p, obs, method=ActorCritic.policy).entropy().sum()

    def value_sum(p):
        return network.apply(p, obs, method=ActorCritic.value).sum()

    for loss in (entropy, value_sum):
        grads = jax.grad(loss)(params)["params"]
        assert np.abs(grads["shared"]["layers_1"]["kernel"]).sum() > 0
    assert not np.abs(jax.grad(value_sum)(params)["params"]["actor"]["layers_0"]["kernel"]).any()


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
        learning_rate=1e-3,  # the continuous preset's
    )
    with pytest.MonkeyPatch.context() as monkeypatch:
        return config, train_one_update(purejaxrl_ppo, monkeypatch, config)


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
