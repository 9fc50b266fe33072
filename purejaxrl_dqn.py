"""DQN for gymnax environments with discrete actions: the whole training run is one compiled JAX
program, replay buffer included.

    python purejaxrl_dqn.py --env CartPole
    python purejaxrl_dqn.py --env Breakout --num-seeds 4   # MinAtar Breakout (gymnax), not ALE
    python purejaxrl_dqn.py --env CartPole --n-step 1 --no-double-dqn   # classic DQN targets

Double DQN and 3-step returns by default, a squared or Huber TD loss and an optional dueling
head. Time limits are not terminal states: a truncated episode bootstraps from the observation it
was cut off in.

Read top to bottom: Config and presets, the Q-network, the pure pieces (epsilon schedule, replay
buffer, n-step / Double-DQN targets and the loss), then `make_train`, whose `_update_step` is one
DQN iteration: every environment takes `train_frequency` epsilon-greedy steps into the buffer ->
`gradient_steps` Adam steps on sampled n-step windows -> target network update.
"""

from __future__ import annotations

# First of all: from here on a Ctrl-C, even during the slow imports below, exits with one line.
import utils.interrupts  # noqa: F401  # isort: skip

import dataclasses
import functools
from typing import Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from utils.cli import (
    INT32_MAX,
    EpisodeRunConfig,
    exit_on_config_error,
    parse_config,
    require_in,
    require_positive,
)
from utils.devices import DEVICE_AXIS, device_mean
from utils.driver import run_training
from utils.envs import EPISODE_INFO, env_family, env_spec, episode_metrics, make_env
from utils.errors import ConfigError
from utils.evaluation import Policy, evaluate_policy, memoryless
from utils.layers import Conv3x3
from utils.trainer import Runtime, Trainer, hyperparams_of, scan_updates


@dataclasses.dataclass
class Config(EpisodeRunConfig):
    """DQN (Double DQN, n-step returns, dueling head) on gymnax environments with discrete
    actions, compiled end to end with JAX."""

    env: str = "CartPole"
    """alias (CartPole, Acrobot, MountainCar, Breakout, Asterix, Freeway, SpaceInvaders,
    Seaquest, ...) or gymnax id, discrete actions only; Breakout & co. are the MinAtar games of
    gymnax, not ALE Atari. Each env family has its own preset defaults"""
    total_timesteps: int = 500_000
    """environment steps per seed (all devices together)"""
    learning_rate: float = 5e-4
    """Adam learning rate"""
    num_envs: int = 20
    """parallel environments per seed, split across devices"""
    buffer_size: int = 50_000
    """replay memory size in transitions per seed (rounded down to a multiple of --num-envs)"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 1.0
    """target network update rate: 1.0 copies the online network, below 1 is Polyak averaging"""
    target_network_frequency: int = 500
    """env steps between two target network updates"""
    batch_size: int = 128
    """transitions sampled from the replay memory for each gradient step (all devices together)"""
    start_e: float = 1.0
    """starting epsilon for exploration"""
    end_e: float = 0.05
    """ending epsilon for exploration"""
    exploration_fraction: float = 0.3
    """fraction of total-timesteps it takes from start-e to go to end-e"""
    learning_starts: int = 10_000
    """env steps collected before learning starts"""
    train_frequency: int = 1
    """steps every environment takes between two rounds of gradient steps (with 20 envs, 1
    means a round every 20 env steps)"""
    gradient_steps: int = 1
    """gradient steps in each round"""
    double_dqn: bool = True
    """Double DQN: the online network picks the next action, the target network values it"""
    n_step: int = 3
    """steps of reward summed before bootstrapping, cut at episode ends (1 is classic DQN)"""
    loss: Literal["huber", "mse"] = "mse"
    """TD loss: huber (delta 1, as in the Nature DQN) or mse"""
    dueling: bool = False
    """dueling head: Q = V + A - mean(A)"""
    max_grad_norm: float = 10.0
    """global gradient-norm clipping threshold (SB3's DQN default); 0 turns clipping off, as in
    CleanRL"""
    hidden_sizes: tuple[int, ...] = (64, 64)
    """units of the hidden dense layers, after the convolution for images (CleanRL's and
    PureJaxRL's CartPole network is 120 84)"""


# Defaults per env family; any flag overrides them. Continuous action spaces are rejected.
# "classic" starts from the PureJaxRL / CleanRL CartPole setting (a batch of 128 transitions,
# target copied every 500 env steps, MSE loss as in CleanRL, since Huber diverged on CartPole)
# and adds Double DQN and 3-step returns (Rainbow's value), which learned faster and ended more
# reliably near the maximum, and a 50k memory with epsilon annealed over 30% of the run
# instead of 10k and 50%: sooner to a good policy, and fewer seeds that lose it again. It steps
# 20 envs per gradient step (not 10) with a 64-64 network at learning rate 5e-4: a training
# step costs most of the time, so half as many of them, on a smaller network, trains about
# four times as many env steps per second for a few more env steps to the same return. The n-step windows' off-policy bias stays small because
# windows stop at episode ends and epsilon is low for most of training; --n-step 1 gives
# classic DQN targets.
# "minatar" follows the MinAtar paper's DQN (Young & Tian, 2019: 3x3x16 conv + 128 dense, 100k
# memory, Huber loss) scaled to 128 parallel envs: 2 gradient steps of 128 per 128 env steps
# (2 replayed transitions per env step, 1/16 of the paper's replay ratio), a target copy every
# 10k env steps (~156 gradient steps; the paper: 1000), and CleanRL's Atari epsilon (1 -> 0.01
# over 10% of training).
# The runs behind these choices: docs/dqn.md, "Results".
PRESETS = {
    "classic": {},
    "minatar": dict(
        total_timesteps=10_000_000,
        learning_rate=1e-4,
        num_envs=128,
        buffer_size=100_000,
        batch_size=128,
        target_network_frequency=10_000,
        end_e=0.01,
        exploration_fraction=0.1,
        learning_starts=50_000,
        gradient_steps=2,
        loss="huber",
        hidden_sizes=(128,),
    ),
}


class HyperParams(NamedTuple):
    """Hyperparameters that change no array shape. They travel in the training state as
    arrays, so that --sweep can vary them inside one program; the driver makes those that no
    sweep varies constants of the program (utils/trainer.py)."""

    learning_rate: jax.Array
    gamma: jax.Array
    tau: jax.Array
    start_e: jax.Array
    end_e: jax.Array
    exploration_fraction: jax.Array
    max_grad_norm: jax.Array
    learning_starts: jax.Array  # int32, as the env step counter it is compared with
    target_network_frequency: jax.Array  # int32


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


class QNetwork(nn.Module):
    """Q-values of every action for a batch of observations [B, ...].

    Vectors go through an MLP. MinAtar's 10x10xC images go through the network of the MinAtar
    paper's DQN: one 3x3 convolution with 16 channels (zero-padded, as a matmul: see
    utils/layers.py), then the dense layers (one of 128 units in the preset). The dueling
    head (Wang et al., 2016) adds a state value to advantages centred on their mean.
    """

    num_actions: int
    hidden_sizes: tuple[int, ...]
    dueling: bool
    image: bool

    @nn.compact
    def __call__(self, obs):
        x = obs.astype(jnp.float32)
        if self.image:
            x = nn.relu(Conv3x3(16)(x))
        x = x.reshape(x.shape[0], -1)
        for units in self.hidden_sizes:
            x = nn.relu(nn.Dense(units)(x))
        if not self.dueling:
            return nn.Dense(self.num_actions)(x)
        value = nn.Dense(1)(x)
        advantage = nn.Dense(self.num_actions)(x)
        return value + advantage - advantage.mean(axis=-1, keepdims=True)


# ---------------------------------------------------------------------------------------------
# Exploration, replay buffer, targets and loss
# ---------------------------------------------------------------------------------------------


def linear_epsilon(step, start_e, end_e, duration):
    """Epsilon after `step` env steps: linear from start_e to end_e over `duration` steps, then
    end_e (a duration of 0 means end_e from the start)."""
    fraction = jnp.where(duration > 0, jnp.clip(step / jnp.maximum(duration, 1), 0.0, 1.0), 1.0)
    return start_e + fraction * (end_e - start_e)


class Transition(NamedTuple):
    """One step of every environment: leaves [E, ...] as stepped, [rows, E, ...] in the buffer
    and [B, n, ...] in a sampled batch of n-step windows."""

    obs: jax.Array  # [E, obs_size] the observation acted on, flattened (uint8 for MinAtar)
    action: jax.Array  # [E] int32
    reward: jax.Array  # [E]
    terminated: jax.Array  # [E] 1.0 where the episode ended in a terminal state
    truncated: jax.Array  # [E] 1.0 where a time limit cut the episode off
    next_obs: jax.Array  # [E, obs_size] the observation the step led to, before any reset


# A circular buffer written here rather than taken from flashbax: thirty readable lines, no
# extra dependency, and the layout n-step windows need (rows are time steps, columns are
# environments) in plain sight.
class ReplayBuffer(NamedTuple):
    data: Transition  # leaves [capacity, num_envs, ...]: one row per time step
    pos: jax.Array  # row the next time step goes to
    size: jax.Array  # rows written so far, at most capacity


def buffer_init(example: Transition, capacity: int) -> ReplayBuffer:
    """An empty buffer of `capacity` rows, each shaped like `example` (leaves [num_envs, ...])."""
    data = jax.tree.map(lambda x: jnp.zeros((capacity, *x.shape), x.dtype), example)
    return ReplayBuffer(data, jnp.int32(0), jnp.int32(0))


def buffer_add(buffer: ReplayBuffer, steps: Transition) -> ReplayBuffer:
    """Append consecutive time steps (leaves [T, num_envs, ...], T <= capacity); once the
    buffer is full they overwrite the oldest rows."""
    capacity = buffer.data.reward.shape[0]
    num_steps = steps.reward.shape[0]
    rows = (buffer.pos + jnp.arange(num_steps)) % capacity
    data = jax.tree.map(lambda stored, new: stored.at[rows].set(new), buffer.data, steps)
    return ReplayBuffer(
        data, (buffer.pos + num_steps) % capacity, jnp.minimum(buffer.size + num_steps, capacity)
    )


def buffer_sample(buffer: ReplayBuffer, key, batch_size: int, window: int) -> Transition:
    """`batch_size` windows of `window` consecutive steps of one environment each (leaves
    [batch_size, window, ...]), uniform over all windows that lie in the written rows. The
    caller makes sure there is one (size >= window); an empty buffer yields its zeros."""
    capacity, num_envs = buffer.data.reward.shape
    num_starts = jnp.maximum(buffer.size - window + 1, 1)
    # One draw picks the window's first row and its environment together.
    first = jax.random.randint(key, (batch_size, 1), 0, num_starts * num_envs)
    oldest = (buffer.pos - buffer.size) % capacity
    rows = (oldest + first // num_envs + jnp.arange(window)) % capacity
    flat = rows * num_envs + first % num_envs  # into the leaves' [capacity * num_envs] rows
    return jax.tree.map(lambda x: x.reshape(capacity * num_envs, *x.shape[2:])[flat], buffer.data)


def n_step_return(rewards, terminated, truncated, gamma):
    """Discounted reward of windows of n consecutive steps of one environment (arrays [B, n]),
    cut after the first step that ended an episode.

    Returns (returns, discount, last), each [B]: `last` indexes the window's final step, whose
    next observation the target bootstraps from with weight `discount` = gamma**(last + 1), or
    0 if that step terminated. A truncated step keeps its bootstrap: its next observation is the
    one the time limit cut the episode off in.
    """
    n = rewards.shape[1]
    ended = jnp.maximum(terminated, truncated)
    not_ended_before = jnp.concatenate([jnp.ones_like(ended[:, :1]), 1.0 - ended[:, :-1]], axis=1)
    included = jnp.cumprod(not_ended_before, axis=1)  # step k is still in the first episode
    returns = (included * gamma ** jnp.arange(n) * rewards).sum(axis=1)
    last = included.sum(axis=1).astype(jnp.int32) - 1
    terminated_last = jnp.take_along_axis(terminated, last[:, None], axis=1)[:, 0]
    discount = gamma ** (last + 1.0) * (1.0 - terminated_last)
    return returns, discount, last


def bootstrap_value(next_q_target, next_q_online, double_dqn: bool):
    """Value of the next state, [B, A] -> [B]. Double DQN (van Hasselt et al., 2016) lets the
    online network pick the action and the target network value it, which curbs the max
    operator's overestimation; plain DQN takes the target network's max."""
    if double_dqn:
        action = jnp.argmax(next_q_online, axis=-1)
        return jnp.take_along_axis(next_q_target, action[:, None], axis=-1)[:, 0]
    return next_q_target.max(axis=-1)


def td_targets(batch: Transition, q_target, q_online, gamma, double_dqn: bool):
    """TD targets [B] for windows of n steps (leaves [B, n, ...]); `q_target` and `q_online`
    map next observations [B, ...] to Q-values [B, A]."""
    returns, discount, last = n_step_return(batch.reward, batch.terminated, batch.truncated, gamma)
    next_obs = batch.next_obs[jnp.arange(last.shape[0]), last]
    online = q_online(next_obs) if double_dqn else None
    return returns + discount * bootstrap_value(q_target(next_obs), online, double_dqn)


def td_loss(q_taken, targets, loss: str):
    """Mean TD loss; both kinds are 0.5 * error**2 near zero, Huber is linear beyond 1."""
    if loss == "huber":
        return optax.huber_loss(q_taken, targets).mean()
    return 0.5 * ((q_taken - targets) ** 2).mean()


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


# Shapes: the training functions below see one seed on one device, where E = num_envs /
# devices environments step side by side and B = batch_size / devices windows are sampled.


class TrainState(NamedTuple):
    params: dict  # the online Q-network's parameters, the same on every device
    target_params: dict
    opt_state: optax.OptState
    hparams: HyperParams  # scalars: this run's swept values
    buffer: ReplayBuffer  # leaves [buffer_size / num_envs, E, ...]: this device's envs only
    env_state: object  # leaves [E, ...]
    obs: jax.Array  # [E, *obs_shape] float32, the observation of the next step
    key: jax.Array
    timesteps: jax.Array  # int32: env steps of this seed so far, all devices together


def validate(config: Config, runtime: Runtime) -> None:
    """ConfigError for a config that cannot train; cheap enough to run per sweep configuration."""
    spec = env_spec(config.env)
    if not spec.discrete:
        raise ConfigError(
            f"DQN needs a discrete action space; {spec.env_id} has continuous actions"
        )
    require_positive(
        config,
        "total_timesteps",
        "num_envs",
        "buffer_size",
        "batch_size",
        "target_network_frequency",
        "train_frequency",
        "gradient_steps",
        "n_step",
    )
    require_positive(config, "eval_episodes", minimum=0)
    if not config.hidden_sizes or not all(1 <= size <= INT32_MAX for size in config.hidden_sizes):
        raise ConfigError(
            f"--hidden-sizes must be one or more sizes in [1, {INT32_MAX}], got "
            f"{config.hidden_sizes}"
        )
    require_positive(config, "learning_starts", minimum=0)
    require_in(config, "learning_rate", 0.0, 1.0, above_low=True)
    require_in(config, "tau", 0.0, 1.0, above_low=True)  # 0 would never update the target
    for name in ("gamma", "start_e", "end_e", "exploration_fraction"):
        require_in(config, name, 0.0, 1.0)
    require_in(config, "max_grad_norm", 0.0)  # 0: no clipping
    for name in ("num_envs", "batch_size"):
        if getattr(config, name) % runtime.num_devices:
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(config, name)} is not divisible by the "
                f"{runtime.num_devices} devices"
            )
    if config.buffer_size < config.batch_size:
        raise ConfigError(
            f"--buffer-size {config.buffer_size} is smaller than --batch-size {config.batch_size}"
        )
    buffer_rows = config.buffer_size // config.num_envs
    if buffer_rows < max(config.train_frequency, config.n_step):
        raise ConfigError(
            f"--buffer-size {config.buffer_size} keeps only {buffer_rows} steps of each of the "
            f"{config.num_envs} envs, fewer than --train-frequency {config.train_frequency} or "
            f"--n-step {config.n_step}"
        )
    steps_per_update = config.num_envs * config.train_frequency
    num_updates = config.total_timesteps // steps_per_update
    if num_updates < 1:
        raise ConfigError(
            f"--total-timesteps {config.total_timesteps} is less than one update "
            f"(--num-envs x --train-frequency = {steps_per_update})"
        )
    if config.learning_starts >= num_updates * steps_per_update:
        raise ConfigError(
            f"--learning-starts {config.learning_starts} leaves no gradient step within the "
            f"{num_updates * steps_per_update} env steps of --total-timesteps"
        )


def make_train(config: Config, runtime: Runtime | None = None) -> Trainer:
    """Build the pure training functions of a valid config (nothing is compiled here); without
    a runtime, for one run on one device."""
    runtime = runtime or Runtime()
    env, env_params, spec = make_env(config.env)
    buffer_rows = config.buffer_size // config.num_envs  # time steps kept of each environment
    steps_per_update = config.num_envs * config.train_frequency
    num_updates = config.total_timesteps // steps_per_update
    envs_per_device = config.num_envs // runtime.num_devices
    batch_per_device = config.batch_size // runtime.num_devices
    # MinAtar observations are 0/1 channels: as uint8 the buffer (and every checkpoint of it)
    # takes a quarter of the memory. The network casts back to float32.
    obs_dtype = jnp.uint8 if env_family(spec.env_id) == "minatar" else jnp.float32

    network = QNetwork(
        spec.num_actions, tuple(config.hidden_sizes), config.dueling, len(spec.obs_shape) == 3
    )

    # The buffer keeps observations flattened, [rows, E, obs_size]: a TPU lays out an array's
    # last two dimensions in tiles (8 x 128 for float32, 32 x 128 for uint8), so MinAtar's
    # [10, 10, 4] kept as it is would take about a hundred times its size.
    def stored(obs):
        """Observations [E, *obs_shape] as the buffer keeps them, [E, obs_size]."""
        return obs.reshape(obs.shape[0], -1).astype(obs_dtype)

    def q_values(params, obs):
        """Q-values [B, A] of stored observations [B, obs_size]."""
        return network.apply(params, obs.reshape(obs.shape[0], *spec.obs_shape))

    def make_optimizer(hp: HyperParams):
        # An infinite threshold never clips, so clipping can be switched off inside the program.
        max_norm = jnp.where(hp.max_grad_norm > 0, hp.max_grad_norm, jnp.inf)
        # On the parameters as one flat vector, as in purejaxrl_ppo.py: it compiles faster.
        clipped_adam = optax.chain(
            optax.clip_by_global_norm(max_norm), optax.adam(hp.learning_rate)
        )
        return optax.flatten(clipped_adam)

    def init(key, hp: HyperParams) -> TrainState:
        params_key, run_key = jax.random.split(key)
        # Same parameters on every device; environments, exploration and sampling differ.
        run_key = jax.random.fold_in(run_key, jax.lax.axis_index(DEVICE_AXIS))
        reset_key, run_key = jax.random.split(run_key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, envs_per_device), env_params
        )
        params = network.init(params_key, obs)
        zeros = jnp.zeros(envs_per_device, jnp.float32)
        stored_obs = stored(obs)
        example = Transition(
            stored_obs, jnp.zeros(envs_per_device, jnp.int32), zeros, zeros, zeros, stored_obs
        )
        return TrainState(
            params=params,
            target_params=params,
            opt_state=make_optimizer(hp).init(params),
            hparams=hp,
            buffer=buffer_init(example, buffer_rows),
            env_state=env_state,
            obs=obs,
            key=run_key,
            timesteps=jnp.int32(0),
        )

    def _update_step(state: TrainState, _):
        hp = state.hparams
        optimizer = make_optimizer(hp)

        # 1. Act: every environment takes train_frequency epsilon-greedy steps into the buffer.
        def _env_step(state: TrainState, _):
            key, explore_key, action_key, step_key = jax.random.split(state.key, 4)
            epsilon = linear_epsilon(
                state.timesteps,
                hp.start_e,
                hp.end_e,
                hp.exploration_fraction * config.total_timesteps,
            )
            greedy = jnp.argmax(network.apply(state.params, state.obs), axis=-1)
            random_action = jax.random.randint(action_key, greedy.shape, 0, spec.num_actions)
            explore = jax.random.uniform(explore_key, greedy.shape) < epsilon
            action = jnp.where(explore, random_action, greedy)
            obs, env_state, reward, terminated, truncated, info = jax.vmap(
                env.step, in_axes=(0, 0, 0, None)
            )(jax.random.split(step_key, envs_per_device), state.env_state, action, env_params)
            transition = Transition(
                stored(state.obs),
                action,
                reward.astype(jnp.float32),
                terminated.astype(jnp.float32),
                truncated.astype(jnp.float32),
                stored(info["final_observation"]),
            )
            episode = (terminated | truncated, *(info[k] for k in EPISODE_INFO))
            state = state._replace(
                env_state=env_state, obs=obs, key=key, timesteps=state.timesteps + config.num_envs
            )
            return state, (transition, episode, epsilon)

        state, (steps, (done, *episode), epsilon) = jax.lax.scan(
            _env_step, state, None, config.train_frequency
        )
        state = state._replace(buffer=buffer_add(state.buffer, steps))

        # 2. Learn: gradient_steps Adam steps on n-step windows sampled from the buffer, once
        # learning_starts env steps are in and the buffer holds a whole window.
        def _gradient_step(carry, key):
            params, opt_state = carry
            batch = buffer_sample(state.buffer, key, batch_per_device, config.n_step)
            targets = td_targets(
                batch,
                functools.partial(q_values, state.target_params),
                functools.partial(q_values, params),
                hp.gamma,
                config.double_dqn,
            )

            def _loss(params):
                q = q_values(params, batch.obs[:, 0])
                q_taken = jnp.take_along_axis(q, batch.action[:, :1], axis=-1)[:, 0]
                return td_loss(q_taken, targets, config.loss), q_taken.mean()

            (loss, q_mean), grads = jax.value_and_grad(_loss, has_aux=True)(params)
            grads = device_mean(grads)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (loss, q_mean)

        def _learn(state: TrainState, keys):
            (params, opt_state), (loss, q_mean) = jax.lax.scan(
                _gradient_step, (state.params, state.opt_state), keys
            )
            return params, opt_state, loss.mean(), q_mean.mean()

        def _wait(state: TrainState, keys):
            return state.params, state.opt_state, jnp.float32(jnp.nan), jnp.float32(jnp.nan)

        key, learn_key = jax.random.split(state.key)
        # A split into a single key runs its hash on a TPU's scalar unit, between the vector
        # kernels (docs/benchmarks.md, "DQN's learn keys on the TPU"). JAX's threefry keys do
        # not depend on how many are split, so the first gradient_steps of a split into two or
        # more are the same keys; the golden runs check that they are.
        learn_keys = jax.random.split(learn_key, max(config.gradient_steps, 2))
        learning = (state.timesteps >= hp.learning_starts) & (state.buffer.size >= config.n_step)
        params, opt_state, loss, q_mean = jax.lax.cond(
            learning, _learn, _wait, state, learn_keys[: config.gradient_steps]
        )

        # 3. Target network: once per multiple of target_network_frequency env steps crossed.
        period = hp.target_network_frequency
        crossed = state.timesteps // period > (state.timesteps - steps_per_update) // period
        target_params = jax.lax.cond(
            learning & crossed,
            lambda: optax.incremental_update(params, state.target_params, hp.tau),
            lambda: state.target_params,
        )
        state = state._replace(
            params=params, target_params=target_params, opt_state=opt_state, key=key
        )

        # 4. Metrics, reduced here so nothing per-step is kept: episodes that ended this update.
        metrics = {
            **episode_metrics(done, *episode),
            "loss": device_mean(loss),
            "q_mean": device_mean(q_mean),
            "epsilon": epsilon[-1],
        }
        return state, metrics

    def train_chunk(state: TrainState, num_updates: int, num_active=None):
        return scan_updates(_update_step, state, num_updates, num_active)

    def greedy_policy(state: TrainState) -> Policy:
        return memoryless(lambda obs: jnp.argmax(network.apply(state.params, obs), axis=-1))

    def evaluate(state: TrainState, key):
        return evaluate_policy(
            env, env_params, greedy_policy(state), key, config.eval_episodes, spec.max_episode_steps
        )

    return Trainer(
        algo="dqn",
        env_id=spec.env_id,
        num_updates=num_updates,
        steps_per_update=steps_per_update,
        hyperparams=hyperparams_of(HyperParams, config),
        init=init,
        train_chunk=train_chunk,
        evaluate=evaluate if config.eval_episodes else None,
        runtime=runtime,
        video_policy=greedy_policy if config.capture_video else None,
        guarded_metrics=("loss",),  # NaN until learning starts
        guarded_state=lambda state: (state.params, state.target_params, state.opt_state),
    )


def main() -> None:
    """The command line: parse the flags, then train."""
    with exit_on_config_error():
        run_training(parse_config(Config, PRESETS), make_train, validate)


if __name__ == "__main__":
    main()
