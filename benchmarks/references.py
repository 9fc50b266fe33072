"""The systems our trainers are measured against, rebuilt from their published descriptions.

- PureJaxRL's PPO (ppo.py and its MinAtar notebook): `reference_ppo`.
- PureJaxRL's DQN (dqn.py): `reference_dqn`.
- pgx's AlphaZero example (examples/alphazero/train.py): its network (`ReferenceNet`), its
  self-play step (`reference_selfplay`) and its whole loop of self-play, value targets and SGD
  (`ReferenceAlphaZero`).

Each keeps its original's algorithm, settings and structure (what is compiled as one program,
what runs on the host); only the logging is left out. gymnax 1.0's `terminated or truncated`
is the `done` of PureJaxRL's gymnax 0.0 loops. The PPO and DQN loops are an `init(key)` and an
`update(carry, _)` for `lax.scan`, so that a benchmark can run them whole (as their originals
do) or in chunks, and each update reports the returns of the training episodes that ended in
it (`ended_episodes`), which is what PureJaxRL prints when it reports progress.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import flashbax
import flax.linen as nn
import jax
import jax.numpy as jnp
import mctx
import numpy as np
import optax
import pgx
from flax.linen.initializers import constant, orthogonal
from pgx.experimental import auto_reset

from utils.envs import make_env


class ReferenceLoop(NamedTuple):
    """A training loop as `lax.scan` pieces: `init(key) -> carry`, `update(carry, _) -> (carry,
    metrics)`; `num_updates` of `steps_per_update` env steps make its whole run."""

    init: Callable
    update: Callable
    num_updates: int
    steps_per_update: int


def ended_episodes(done, info) -> dict:
    """The sum of the returns of the episodes that ended in a batch of steps, and their number."""
    return {
        "return_sum": jnp.where(done, info["episode_return"], 0.0).sum(),
        "episodes": done.sum(),
    }


# ---------------------------------------------------------------------------------------------
# PureJaxRL's PPO
# ---------------------------------------------------------------------------------------------


class PPOSettings(NamedTuple):
    learning_rate: float
    num_envs: int
    num_steps: int
    total_timesteps: int
    update_epochs: int
    num_minibatches: int
    activation: str  # "tanh" or "relu"
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5


# ppo.py's CartPole configuration, and its MinAtar notebook's
PPO_CARTPOLE = PPOSettings(2.5e-4, 4, 128, 500_000, 4, 4, "tanh")
PPO_MINATAR = PPOSettings(5e-3, 64, 128, 10_000_000, 4, 8, "relu")


class ReferenceActorCritic(nn.Module):
    """Separate actor and critic MLPs of two 64-unit layers, orthogonal initialisation, on the
    flattened observation: (action logits, value)."""

    num_actions: int
    activation: str

    @nn.compact
    def __call__(self, x):
        act = nn.relu if self.activation == "relu" else nn.tanh

        def mlp(x, out: int, scale: float):
            for _ in range(2):
                x = act(nn.Dense(64, kernel_init=orthogonal(np.sqrt(2)), bias_init=constant(0))(x))
            return nn.Dense(out, kernel_init=orthogonal(scale), bias_init=constant(0))(x)

        return mlp(x, self.num_actions, 0.01), mlp(x, 1, 1.0)[..., 0]


def flat(obs):
    """Observations [envs, ...] flattened, as PureJaxRL's FlattenObservationWrapper gives them."""
    return obs.reshape(obs.shape[0], -1)


def reference_gae(values, rewards, dones, last_value, s: PPOSettings):
    """PureJaxRL's GAE over a rollout [T, E]: (advantages, value targets)."""

    def backward(carry, step):
        advantage, next_value = carry
        value, reward, done = step
        delta = reward + s.gamma * next_value * (1 - done) - value
        advantage = delta + s.gamma * s.gae_lambda * (1 - done) * advantage
        return (advantage, value), advantage

    init = (jnp.zeros_like(last_value), last_value)
    _, advantages = jax.lax.scan(backward, init, (values, rewards, dones), reverse=True, unroll=16)
    return advantages, advantages + values


def reference_ppo(env_name: str, settings: PPOSettings) -> ReferenceLoop:
    """PureJaxRL's PPO: rollout of num_envs x num_steps, GAE, then update_epochs epochs of
    num_minibatches shuffled minibatches of clipped-surrogate Adam steps, the learning rate
    annealed linearly per update."""
    s = settings
    env, env_params, spec = make_env(env_name)
    network = ReferenceActorCritic(spec.num_actions, s.activation)
    num_updates = s.total_timesteps // (s.num_envs * s.num_steps)
    batch_size = s.num_envs * s.num_steps

    def schedule(count):
        return s.learning_rate * (
            1.0 - (count // (s.num_minibatches * s.update_epochs)) / num_updates
        )

    optimizer = optax.chain(
        optax.clip_by_global_norm(s.max_grad_norm), optax.adam(learning_rate=schedule, eps=1e-5)
    )

    def init(key):
        key, init_key, reset_key = jax.random.split(key, 3)
        params = network.init(init_key, jnp.zeros(int(np.prod(spec.obs_shape))))
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, s.num_envs), env_params
        )
        return params, optimizer.init(params), env_state, obs, key

    def env_step(carry, _):
        params, env_state, obs, key = carry
        key, action_key, step_key = jax.random.split(key, 3)
        obs = flat(obs)
        logits, value = network.apply(params, obs)
        action = jax.random.categorical(action_key, logits)
        log_prob = jnp.take_along_axis(jax.nn.log_softmax(logits), action[:, None], -1)[:, 0]
        next_obs, env_state, reward, terminated, truncated, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(step_key, s.num_envs), env_state, action, env_params)
        done = terminated | truncated
        step = (obs, action, log_prob, value, reward, done)
        return (params, env_state, next_obs, key), (step, ended_episodes(done, info))

    def loss(params, batch):
        obs, action, old_log_prob, old_value, advantage, target = batch
        logits, value = network.apply(params, obs)
        log_probs = jax.nn.log_softmax(logits)
        log_prob = jnp.take_along_axis(log_probs, action[:, None], -1)[:, 0]
        clipped_value = old_value + (value - old_value).clip(-s.clip_eps, s.clip_eps)
        value_loss = 0.5 * jnp.maximum((value - target) ** 2, (clipped_value - target) ** 2).mean()
        ratio = jnp.exp(log_prob - old_log_prob)
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        clipped_ratio = jnp.clip(ratio, 1.0 - s.clip_eps, 1.0 + s.clip_eps)
        actor_loss = -jnp.minimum(ratio * advantage, clipped_ratio * advantage).mean()
        entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
        return actor_loss + s.vf_coef * value_loss - s.ent_coef * entropy

    def epoch(carry, _):
        params, opt_state, batch, key = carry
        key, shuffle_key = jax.random.split(key)
        order = jax.random.permutation(shuffle_key, batch_size)
        minibatches = jax.tree.map(
            lambda x: x[order].reshape(s.num_minibatches, -1, *x.shape[1:]), batch
        )

        def minibatch_step(carry, minibatch):
            params, opt_state = carry
            grads = jax.grad(loss)(params, minibatch)
            updates, opt_state = optimizer.update(grads, opt_state)
            return (optax.apply_updates(params, updates), opt_state), None

        (params, opt_state), _ = jax.lax.scan(minibatch_step, (params, opt_state), minibatches)
        return (params, opt_state, batch, key), None

    def update(carry, _):
        params, opt_state, env_state, obs, key = carry
        (params, env_state, obs, key), (steps, episodes) = jax.lax.scan(
            env_step, (params, env_state, obs, key), None, s.num_steps
        )
        step_obs, action, log_prob, value, reward, done = steps
        _, last_value = network.apply(params, flat(obs))
        advantages, targets = reference_gae(value, reward, done, last_value, s)
        batch = (step_obs, action, log_prob, value, advantages, targets)
        batch = jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)
        (params, opt_state, _, key), _ = jax.lax.scan(
            epoch, (params, opt_state, batch, key), None, s.update_epochs
        )
        metrics = jax.tree.map(jnp.sum, episodes)
        return (params, opt_state, env_state, obs, key), metrics

    return ReferenceLoop(init, update, num_updates, batch_size)


# ---------------------------------------------------------------------------------------------
# PureJaxRL's DQN
# ---------------------------------------------------------------------------------------------

# dqn.py's CartPole configuration
DQN_NUM_ENVS = 10
DQN_BUFFER_SIZE = 10_000
DQN_BATCH_SIZE = 128
DQN_EPSILON_START, DQN_EPSILON_FINISH, DQN_EPSILON_ANNEAL_TIME = 1.0, 0.05, 250_000
DQN_TARGET_UPDATE_INTERVAL = 500
DQN_LEARNING_RATE = 2.5e-4
DQN_LEARNING_STARTS = 10_000
DQN_TRAINING_INTERVAL = 10
DQN_GAMMA = 0.99


class ReferenceQNetwork(nn.Module):
    num_actions: int

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(120)(x))
        x = nn.relu(nn.Dense(84)(x))
        return nn.Dense(self.num_actions)(x)


class Step(NamedTuple):
    obs: jax.Array
    action: jax.Array
    reward: jax.Array
    done: jax.Array


def reference_dqn(env_name: str, total_timesteps: int) -> ReferenceLoop:
    """PureJaxRL's DQN loop: 10 environments stepped once per update, a flashbax flat buffer,
    one Adam step on 128 sampled transitions every 10 env steps once 10k are in, plain 1-step
    targets from a target network copied every 500 steps, epsilon annealed 1 -> 0.05."""
    env, env_params, spec = make_env(env_name)
    network = ReferenceQNetwork(spec.num_actions)
    optimizer = optax.adam(DQN_LEARNING_RATE)
    buffer = flashbax.make_flat_buffer(
        max_length=DQN_BUFFER_SIZE,
        min_length=DQN_BATCH_SIZE,
        sample_batch_size=DQN_BATCH_SIZE,
        add_sequences=False,
        add_batch_size=DQN_NUM_ENVS,
    )

    def init(key):
        key, reset_key, init_key = jax.random.split(key, 3)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, DQN_NUM_ENVS), env_params
        )
        params = network.init(init_key, obs)
        example = Step(obs[0], jnp.int32(0), jnp.float32(0), jnp.bool_(False))
        carry = (params, params, optimizer.init(params), buffer.init(example), env_state, obs)
        return (*carry, jnp.int32(0), key)

    def learn(params, opt_state, target_params, buffer_state, key):
        batch = buffer.sample(buffer_state, key).experience
        next_q = network.apply(target_params, batch.second.obs).max(-1)
        target = batch.first.reward + (1 - batch.first.done) * DQN_GAMMA * next_q

        def td_loss(params):
            q = network.apply(params, batch.first.obs)
            chosen = jnp.take_along_axis(q, batch.first.action[:, None], -1)[:, 0]
            return jnp.mean((chosen - target) ** 2)

        loss, grads = jax.value_and_grad(td_loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, loss

    def update(carry, _):
        params, target_params, opt_state, buffer_state, env_state, last_obs, t, key = carry
        key, explore_key, choice_key, step_key, sample_key = jax.random.split(key, 5)
        q = network.apply(params, last_obs)
        epsilon = jnp.clip(
            (DQN_EPSILON_FINISH - DQN_EPSILON_START) / DQN_EPSILON_ANNEAL_TIME * t
            + DQN_EPSILON_START,
            DQN_EPSILON_FINISH,
        )
        random_action = jax.random.randint(choice_key, (DQN_NUM_ENVS,), 0, spec.num_actions)
        explore = jax.random.uniform(explore_key, (DQN_NUM_ENVS,)) < epsilon
        action = jnp.where(explore, random_action, q.argmax(-1))
        obs, env_state, reward, terminated, truncated, info = jax.vmap(
            env.step, in_axes=(0, 0, 0, None)
        )(jax.random.split(step_key, DQN_NUM_ENVS), env_state, action, env_params)
        done = terminated | truncated
        t = t + DQN_NUM_ENVS
        buffer_state = buffer.add(buffer_state, Step(last_obs, action, reward, done))
        learn_now = (
            buffer.can_sample(buffer_state)
            & (t > DQN_LEARNING_STARTS)
            & (t % DQN_TRAINING_INTERVAL == 0)
        )
        params, opt_state, loss = jax.lax.cond(
            learn_now,
            learn,
            lambda p, o, *_: (p, o, jnp.float32(0)),
            params,
            opt_state,
            target_params,
            buffer_state,
            sample_key,
        )
        target_params = jax.lax.cond(
            t % DQN_TARGET_UPDATE_INTERVAL == 0, lambda: params, lambda: target_params
        )
        metrics = {"loss": loss, **ended_episodes(done, info)}
        carry = (params, target_params, opt_state, buffer_state, env_state, obs, t, key)
        return carry, metrics

    return ReferenceLoop(init, update, total_timesteps // DQN_NUM_ENVS, DQN_NUM_ENVS)


# ---------------------------------------------------------------------------------------------
# pgx's AlphaZero example
# ---------------------------------------------------------------------------------------------


def _norm(x, train: bool):
    """The example's BatchNorm (Haiku's, decay 0.9): batch statistics in SGD, running ones in
    search."""
    return nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)


class ReferenceBlock(nn.Module):
    """pgx example's BlockV2: (BatchNorm, relu, conv) x 2 plus the input."""

    channels: int

    @nn.compact
    def __call__(self, x, train: bool = False):
        y = nn.Conv(self.channels, (3, 3))(nn.relu(_norm(x, train)))
        y = nn.Conv(self.channels, (3, 3))(nn.relu(_norm(y, train)))
        return x + y


class ReferenceNet(nn.Module):
    """pgx example's AZNet with resnet_v2=True: (policy logits, value in [-1, 1])."""

    num_actions: int
    channels: int = 32
    blocks: int = 2

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.channels, (3, 3))(x.astype(jnp.float32))
        for _ in range(self.blocks):
            x = ReferenceBlock(self.channels)(x, train)
        x = nn.relu(_norm(x, train))
        policy = nn.relu(_norm(nn.Conv(2, (1, 1))(x), train))
        logits = nn.Dense(self.num_actions)(policy.reshape(policy.shape[0], -1))
        value = nn.relu(_norm(nn.Conv(1, (1, 1))(x), train))
        value = nn.relu(nn.Dense(self.channels)(value.reshape(value.shape[0], -1)))
        return logits, jnp.tanh(nn.Dense(1)(value))[:, 0]


class SelfPlayData(NamedTuple):
    """The example's StepFnOutput, leaves [steps, games, ...]."""

    obs: jax.Array
    action_weights: jax.Array
    reward: jax.Array  # the mover's reward for its move
    terminated: jax.Array
    discount: jax.Array  # -1 between the players, 0 where the game ended


def reference_selfplay(env, net: nn.Module, num_games: int, steps: int, simulations: int):
    """The example's self-play on one device: `num_games` new games, each making `steps`
    Gumbel MuZero moves (games that end restart, `auto_reset`). Returns `selfplay(variables,
    key) -> SelfPlayData`, to be pmapped."""

    def recurrent_fn(variables, key, action, state):
        player = state.current_player
        state = jax.vmap(env.step)(state, action)
        logits, value = net.apply(variables, state.observation)
        logits = logits - jnp.max(logits, axis=-1, keepdims=True)
        logits = jnp.where(state.legal_action_mask, logits, jnp.finfo(logits.dtype).min)
        output = mctx.RecurrentFnOutput(
            reward=state.rewards[jnp.arange(num_games), player],
            discount=jnp.where(state.terminated, 0.0, -1.0),
            prior_logits=logits,
            value=jnp.where(state.terminated, 0.0, value),
        )
        return output, state

    def selfplay(variables, key):
        def step_fn(state, key):
            search_key, reset_key = jax.random.split(key)
            logits, value = net.apply(variables, state.observation)
            root = mctx.RootFnOutput(prior_logits=logits, value=value, embedding=state)
            output = mctx.gumbel_muzero_policy(
                params=variables,
                rng_key=search_key,
                root=root,
                recurrent_fn=recurrent_fn,
                num_simulations=simulations,
                invalid_actions=~state.legal_action_mask,
                qtransform=mctx.qtransform_completed_by_mix_value,
                gumbel_scale=1.0,
            )
            player = state.current_player
            keys = jax.random.split(reset_key, num_games)
            next_state = jax.vmap(auto_reset(env.step, env.init))(state, output.action, keys)
            return next_state, SelfPlayData(
                obs=state.observation,
                action_weights=output.action_weights,
                reward=next_state.rewards[jnp.arange(num_games), player],
                terminated=next_state.terminated,
                discount=jnp.where(next_state.terminated, 0.0, -1.0),
            )

        init_key, key = jax.random.split(key)
        state = jax.vmap(env.init)(jax.random.split(init_key, num_games))
        _, data = jax.lax.scan(step_fn, state, jax.random.split(key, steps))
        return data

    return selfplay


class AZSettings(NamedTuple):
    """The example's settings (its Config), all devices together."""

    selfplay_batch_size: int  # games
    max_num_steps: int  # moves of every game slot per iteration
    training_batch_size: int
    num_simulations: int
    learning_rate: float
    num_channels: int
    num_layers: int


# The example's defaults are 1024 games, 6 blocks of 128 channels and SGD batches of 4096,
# sized for a GPU. On a CPU: its network at az_selfplay.py's 2 x 32, 128 games as our presets
# play, and the batch at its 4 positions per game; its 256 moves per game, 32 simulations and
# learning rate as they are.
AZ_ON_CPU = AZSettings(128, 256, 512, 32, 1e-3, 32, 2)


class Sample(NamedTuple):
    obs: jax.Array
    policy_target: jax.Array
    value_target: jax.Array
    mask: jax.Array  # the position's game ended within the window: its value target is known


def selfplay_targets(data: SelfPlayData) -> Sample:
    """The example's compute_loss_input: each position's outcome for its mover, summed back
    from the end of the window; positions whose game did not end get no value target."""
    known = jnp.cumsum(data.terminated[::-1], axis=0)[::-1] >= 1

    def backward(later_value, step):
        reward, discount = step
        value = reward + discount * later_value
        return value, value

    _, value = jax.lax.scan(
        backward, jnp.zeros(data.reward.shape[1]), (data.reward, data.discount), reverse=True
    )
    return Sample(data.obs, data.action_weights, value, known)


class ReferenceAlphaZero:
    """The example's whole loop as its `__main__` runs it, on the local devices: per iteration,
    pmapped self-play and value targets, the positions fetched to the host and shuffled, then
    one epoch of pmapped SGD steps (gradients averaged over the devices) from a Python loop,
    each step's losses read back. Its evaluation against a baseline model is left out (pgx has
    none for these games); the benchmark evaluates instead."""

    def __init__(self, game: str, settings: AZSettings):
        self.settings = settings
        self.env = pgx.make(game)
        self.devices = jax.local_device_count()
        self.net = ReferenceNet(self.env.num_actions, settings.num_channels, settings.num_layers)
        self.optimizer = optax.adam(settings.learning_rate)
        games = settings.selfplay_batch_size // self.devices
        self._selfplay = jax.pmap(
            reference_selfplay(
                self.env, self.net, games, settings.max_num_steps, settings.num_simulations
            )
        )
        self._targets = jax.pmap(selfplay_targets)
        self._train = jax.pmap(self._sgd_step, axis_name="i")

    def _sgd_step(self, variables, opt_state, batch: Sample):
        def loss(params):
            (logits, value), updated = self.net.apply(
                {**variables, "params": params}, batch.obs, train=True, mutable=["batch_stats"]
            )
            policy_loss = optax.softmax_cross_entropy(logits, batch.policy_target).mean()
            value_loss = (optax.l2_loss(value, batch.value_target) * batch.mask).mean()
            return policy_loss + value_loss, (updated["batch_stats"], policy_loss, value_loss)

        grads, (batch_stats, *losses) = jax.grad(loss, has_aux=True)(variables["params"])
        grads = jax.lax.pmean(grads, axis_name="i")
        updates, opt_state = self.optimizer.update(grads, opt_state)
        params = optax.apply_updates(variables["params"], updates)
        return {"params": params, "batch_stats": batch_stats}, opt_state, *losses

    def init(self, key):
        """(variables, optimiser state), replicated over the devices."""
        example = jax.vmap(self.env.init)(jax.random.split(key, 2))
        variables = self.net.init(key, example.observation)
        replicate = functools.partial(
            jax.tree.map, lambda x: jnp.stack([jnp.asarray(x)] * self.devices)
        )
        return replicate(variables), replicate(self.optimizer.init(variables["params"]))

    def compile(self, variables, opt_state, key):
        """Compile every program of an iteration ahead of its first call."""
        keys = jax.random.split(key, self.devices)
        data = jax.eval_shape(self._selfplay, variables, keys)
        samples = jax.eval_shape(self._targets, data)
        self._selfplay = self._selfplay.lower(variables, keys).compile()
        self._targets = self._targets.lower(data).compile()
        per_device = self.settings.training_batch_size // self.devices
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self.devices, per_device, *x.shape[3:]), x.dtype),
            samples,
        )
        self._train = self._train.lower(variables, opt_state, batch).compile()

    def iterate(self, variables, opt_state, key):
        """One iteration: self-play, targets, and an epoch of SGD over the shuffled positions."""
        selfplay_key, shuffle_key = jax.random.split(key)
        data = self._selfplay(variables, jax.random.split(selfplay_key, self.devices))
        samples = jax.device_get(self._targets(data))  # [devices, steps, games, ...]
        samples = jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), samples)
        order = np.asarray(jax.random.permutation(shuffle_key, samples.obs.shape[0]))
        num_updates = samples.obs.shape[0] // self.settings.training_batch_size
        minibatches = jax.tree.map(
            lambda x: x[order].reshape(num_updates, self.devices, -1, *x.shape[1:]), samples
        )
        losses = []
        for i in range(num_updates):
            batch = jax.tree.map(lambda x, i=i: x[i], minibatches)
            variables, opt_state, *step_losses = self._train(variables, opt_state, batch)
            # read back at every step, as the example logs them: it waits for each SGD step
            losses.append([loss.mean().item() for loss in step_losses])
        return variables, opt_state

    @property
    def moves_per_iteration(self) -> int:
        return self.settings.selfplay_batch_size * self.settings.max_num_steps
