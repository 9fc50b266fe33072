"""PPO for gymnax environments: the whole training run is one compiled JAX program.

    python purejaxrl_ppo.py --env CartPole
    python purejaxrl_ppo.py --env Breakout --num-seeds 4   # MinAtar Breakout (gymnax), not ALE

Read top to bottom: Config and presets, the network and its action distributions (feed-forward,
or with a GRU for --memory gru), the running statistics of --normalize-obs / --normalize-reward,
the two targets-and-loss functions (GAE and the clipped PPO loss), then `make_train`, whose
`_update_step` is one PPO iteration: rollout -> GAE -> epochs x shuffled minibatches of Adam
steps.
"""

from __future__ import annotations

# First of all: from here on a Ctrl-C, even during the slow imports below, exits with one line.
import utils.interrupts  # noqa: F401  # isort: skip

import dataclasses
from typing import Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from utils.cli import (
    EpisodeRunConfig,
    exit_on_config_error,
    parse_config,
    require_in,
    require_positive,
)
from utils.devices import DEVICE_AXIS, device_mean, device_sum
from utils.driver import run_training
from utils.envs import env_spec, episode_metrics, make_env
from utils.errors import ConfigError
from utils.evaluation import Policy, evaluate_policy
from utils.layers import Conv3x3, orthogonal
from utils.trainer import Runtime, Trainer, hyperparams_of, scan_updates


@dataclasses.dataclass
class Config(EpisodeRunConfig):
    """PPO (clipped surrogate, GAE) on gymnax environments, compiled end to end with JAX."""

    env: str = "CartPole"
    """alias (CartPole, Acrobot, MountainCar, MountainCarContinuous, Pendulum, Breakout, Asterix,
    Freeway, SpaceInvaders, Seaquest, ...) or gymnax id; Breakout & co. are the MinAtar games of
    gymnax, not ALE Atari. Also Craftax, Craftax-Classic, MiniGrid-DoorKey-5x5 & co.
    (xminigrid), brax:hopper / Hopper & co. (Brax). Each env family has its own preset defaults,
    which some envs refine (docs/ppo.md)"""
    total_timesteps: int = 500_000
    """environment steps per seed (all devices together)"""
    learning_rate: float = 4e-3
    """Adam learning rate"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0, at every optimiser step"""
    num_envs: int = 16
    """parallel environments per seed, split across devices"""
    num_steps: int = 32
    """steps per environment in each rollout"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    num_minibatches: int = 4
    """minibatches per epoch"""
    update_epochs: int = 4
    """epochs over each rollout"""
    norm_adv: bool = True
    """normalise advantages within each minibatch"""
    clip_coef: float = 0.2
    """surrogate clipping coefficient (also clips the value update, see clip_vloss)"""
    clip_vloss: bool = True
    """clip the value-function update as in the PPO paper's implementation"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float = 0.5
    """global gradient-norm clipping threshold; 0 turns clipping off"""
    hidden_size: int = 64
    """units in each of the two hidden layers of the actor and of the critic"""
    activation: Literal["tanh", "relu"] = "tanh"
    """hidden activation"""
    torso: Literal["mlp", "cnn"] = "mlp"
    """mlp: flattened observation; cnn: a 3x3 convolution first (image observations only)"""
    shared_torso: bool = False
    """actor and critic share the torso and first hidden layer, each keeping its second hidden
    layer and head (--memory gru always shares them)"""
    memory: Literal["none", "gru"] = "none"
    """gru: a GRU of hidden-size units between the torso and the heads, carried through each
    episode and reset where one starts, for envs the last observation does not describe;
    none: a feed-forward policy"""
    normalize_obs: bool = False
    """normalise observations by their running mean and std (frozen for evaluation)"""
    normalize_reward: bool = False
    """divide rewards by the running std of the discounted return"""


# Defaults per env family; any flag overrides them. "classic" is PureJaxRL's CartPole setting
# (ppo.py) with the same 512-step rollout as 16 envs x 32 steps instead of 4 x 128, which steps
# faster on a CPU, and learning rate 4e-3 instead of 2.5e-4, which reached CartPole's and
# Acrobot's thresholds in a third of the steps or less and, unlike PureJaxRL's, often solves
# MountainCar. PureJaxRL's own: --num-envs 4 --num-steps 128 --learning-rate 2.5e-4.
# "minatar" is PureJaxRL's MinAtar setting (64 envs x 128 steps, 2 x 64 relu units) with half
# its learning rate, three times its entropy bonus, and each rollout's 32 Adam steps taken as 2
# epochs of 16 minibatches instead of 4 epochs of 8: the rate and bonus keep Breakout from
# stalling where PureJaxRL's own values do, and half as many passes over each rollout train
# more env steps a second at about the same return. The MLP torso, not "cnn", because
# XLA:CPU runs the convolution slowly. An env's own entry refines its family's:
# "Breakout-MinAtar" has actor and critic share their first hidden layer, which on its 400
# inputs is most of the arithmetic, and learns at PureJaxRL's rate: there it stalled less
# and met gymnax's published return sooner, where Asterix at that rate learned less.
# The runs behind these choices: docs/ppo.md, "Results".
PRESETS = {
    "classic": {},
    "minatar": dict(
        total_timesteps=10_000_000,
        learning_rate=2.5e-3,
        num_envs=64,
        num_steps=128,
        num_minibatches=16,
        update_epochs=2,
        ent_coef=0.03,
        activation="relu",
    ),
    "Breakout-MinAtar": dict(shared_torso=True, learning_rate=5e-3),
    "continuous": dict(
        total_timesteps=1_000_000,
        learning_rate=1e-3,
        num_envs=16,
        num_steps=128,
        num_minibatches=8,
        update_epochs=10,
        gamma=0.95,
        ent_coef=0.0,
    ),
    # The Craftax paper's PPO baseline (Matthews et al. 2024, github.com/MichaelTMatthews/Craftax
    # ppo.py: 1024 envs x 64 steps, 8 minibatches, 4 epochs, lr 2e-4, GAE lambda 0.8, 512-unit
    # layers, grad norm 1.0), with 64 envs instead of 1024 for CPU (a GPU takes the 1024).
    "craftax": dict(
        total_timesteps=5_000_000,
        learning_rate=2e-4,
        num_envs=64,
        num_steps=64,
        num_minibatches=8,
        update_epochs=4,
        gae_lambda=0.8,
        max_grad_norm=1.0,
        hidden_size=512,
        activation="relu",
    ),
    # XLand-MiniGrid's single-task PPO (train_single_task.py: lr 1e-3, 16 steps per rollout,
    # 16 minibatches, 1 epoch, over 8192 envs) scaled to CPU: 64 envs x 32 steps, 4 minibatches,
    # with the MLP torso on the one-hot view.
    "gridworld": dict(
        total_timesteps=1_000_000,
        learning_rate=1e-3,
        num_envs=64,
        num_steps=32,
        num_minibatches=4,
        update_epochs=4,
        hidden_size=128,
        activation="relu",
    ),
    # PureJaxRL's continuous PPO on Brax (ppo_continuous_action.py: lr 3e-4, no annealing,
    # 2048 envs x 10 steps, 32 minibatches, 4 epochs, tanh 256, entropy 0, normalised
    # observations and rewards) scaled to CPU: 128 envs x 32 steps, 16 minibatches of 256. On a
    # GPU take PureJaxRL's own batch: --num-envs 2048 --num-steps 10 --num-minibatches 32.
    "brax": dict(
        total_timesteps=5_000_000,
        learning_rate=3e-4,
        anneal_lr=False,
        num_envs=128,
        num_steps=32,
        num_minibatches=16,
        update_epochs=4,
        ent_coef=0.0,
        hidden_size=256,
        normalize_obs=True,
        normalize_reward=True,
    ),
}


class HyperParams(NamedTuple):
    """Hyperparameters that change no array shape. They travel in the training state as
    arrays, so that --sweep can vary them inside one program; the driver makes those that no
    sweep varies constants of the program (utils/trainer.py)."""

    learning_rate: jax.Array
    gamma: jax.Array
    gae_lambda: jax.Array
    clip_coef: jax.Array
    ent_coef: jax.Array
    vf_coef: jax.Array
    max_grad_norm: jax.Array


# ---------------------------------------------------------------------------------------------
# Network and action distributions
# ---------------------------------------------------------------------------------------------


class Categorical(NamedTuple):
    logits: jax.Array

    def sample(self, key):
        return jax.random.categorical(key, self.logits)

    def log_prob(self, action):
        log_probs = jax.nn.log_softmax(self.logits)
        return jnp.take_along_axis(log_probs, action[..., None], axis=-1)[..., 0]

    def entropy(self):
        log_probs = jax.nn.log_softmax(self.logits)
        return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)

    def mode(self):
        return jnp.argmax(self.logits, axis=-1)


class DiagGaussian(NamedTuple):
    mean: jax.Array
    log_std: jax.Array

    def sample(self, key):
        return self.mean + jnp.exp(self.log_std) * jax.random.normal(key, self.mean.shape)

    def log_prob(self, action):
        z = (action - self.mean) * jnp.exp(-self.log_std)
        return jnp.sum(-0.5 * z**2 - self.log_std - 0.5 * jnp.log(2 * jnp.pi), axis=-1)

    def entropy(self):
        return jnp.sum(self.log_std + 0.5 * (1.0 + jnp.log(2 * jnp.pi)), axis=-1)

    def mode(self):
        return self.mean


def action_distribution(out, discrete: bool, log_std=None):
    """The policy a head's output describes: logits, or a Gaussian's mean with `log_std`."""
    if discrete:
        return Categorical(out)
    return DiagGaussian(out, jnp.broadcast_to(log_std, out.shape))


class ActorCritic(nn.Module):
    """The actor and the critic (CleanRL's layout and orthogonal initialisation).

    Each is a torso, two hidden layers and a linear head. The "mlp" torso flattens the
    observation; the "cnn" torso first applies a 16-channel 3x3 convolution, as the MinAtar
    paper's networks do, so that positions on the grid stay comparable. By default the two are
    separate networks. With `shared_torso` they share the torso and the first hidden layer and
    keep a second hidden layer and a head each (RecurrentActorCritic's layout without its GRU):
    on a large observation (MinAtar's 400 inputs) that first layer is most of the arithmetic.
    Continuous actions get a state-independent log std.
    """

    num_actions: int
    discrete: bool
    obs_ndim: int
    hidden_size: int
    activation: str
    torso: str
    shared_torso: bool = False

    def setup(self):
        activation = nn.tanh if self.activation == "tanh" else nn.relu

        def torso():
            layers = []
            if self.torso == "cnn":
                layers += [Conv3x3(16, kernel_init=orthogonal(np.sqrt(2))), activation]
            layers += [lambda x: x.reshape(*x.shape[: x.ndim - self.obs_ndim], -1)]
            layers += [nn.Dense(self.hidden_size, kernel_init=orthogonal(np.sqrt(2))), activation]
            return layers

        def head(out_size, out_scale):
            return [
                nn.Dense(self.hidden_size, kernel_init=orthogonal(np.sqrt(2))),
                activation,
                nn.Dense(out_size, kernel_init=orthogonal(out_scale)),
            ]

        if self.shared_torso:
            self.shared = nn.Sequential(torso())
            self.actor = nn.Sequential(head(self.num_actions, 0.01))
            self.critic = nn.Sequential(head(1, 1.0))
        else:
            self.actor = nn.Sequential([*torso(), *head(self.num_actions, 0.01)])
            self.critic = nn.Sequential([*torso(), *head(1, 1.0)])
        if not self.discrete:
            self.log_std = self.param("log_std", nn.initializers.zeros, (self.num_actions,))

    def __call__(self, obs):
        features = self.features(obs)  # the shared torso runs once for both
        return self._policy_of(features), self.critic(features)[..., 0]

    def features(self, obs):
        """What the heads see: the shared torso's output, or the observation itself."""
        return self.shared(obs) if self.shared_torso else obs

    def policy(self, obs):
        return self._policy_of(self.features(obs))

    def value(self, obs):
        return self.critic(self.features(obs))[..., 0]

    def _policy_of(self, features):
        return action_distribution(
            self.actor(features), self.discrete, None if self.discrete else self.log_std
        )


class ResettingGRU(nn.Module):
    """A GRU over a sequence whose carry is set to zeros where an episode starts."""

    features: int

    @nn.compact
    def __call__(self, carry, xs, starts):
        """carry [B, H] before the sequence, xs [T, B, F], starts [T, B] bool -> (carry after
        the sequence, outputs [T, B, H]; the output of a step is the carry after it)."""

        def _step(cell, carry, step):
            x, start = step
            # Where x begins an episode, nothing from the episode before may reach it.
            return cell(jnp.where(start[:, None], 0.0, carry), x)

        scan = nn.scan(_step, variable_broadcast="params", split_rngs={"params": False})
        return scan(
            nn.GRUCell(self.features, recurrent_kernel_init=orthogonal()), carry, (xs, starts)
        )


class RecurrentActorCritic(nn.Module):
    """--memory gru: PureJaxRL's recurrent layout. A torso (the 3x3 convolution of the "cnn"
    torso if asked, then one hidden layer), a GRU that actor and critic share, then one hidden
    layer and a linear head each. A GRU rather than an LSTM: one carry array instead of two,
    and as good on the memory tasks PureJaxRL and popgym report. The memory is the GRU's carry,
    [B, hidden_size]."""

    num_actions: int
    discrete: bool
    obs_ndim: int
    hidden_size: int
    activation: str
    torso: str

    @nn.compact
    def __call__(self, memory, obs, starts):
        """obs [T, B, *obs_shape] with starts [T, B] (True where obs begins an episode), from
        `memory` [B, H] before obs[0] -> (memory after obs[-1], policy [T, B], value [T, B])."""
        activation = nn.tanh if self.activation == "tanh" else nn.relu
        x = obs
        if self.torso == "cnn":
            x = activation(Conv3x3(16, kernel_init=orthogonal(np.sqrt(2)))(x))
        x = x.reshape(*x.shape[: x.ndim - self.obs_ndim], -1)
        x = activation(nn.Dense(self.hidden_size, kernel_init=orthogonal(np.sqrt(2)))(x))
        memory, x = ResettingGRU(self.hidden_size)(memory, x, starts)

        def head(out_size, out_scale):
            hidden = nn.Dense(self.hidden_size, kernel_init=orthogonal(np.sqrt(2)))
            return nn.Sequential(
                [hidden, activation, nn.Dense(out_size, kernel_init=orthogonal(out_scale))]
            )

        log_std = None
        if not self.discrete:
            log_std = self.param("log_std", nn.initializers.zeros, (self.num_actions,))
        pi = action_distribution(head(self.num_actions, 0.01)(x), self.discrete, log_std)
        return memory, pi, head(1, 1.0)(x)[..., 0]

    def step(self, memory, obs, starts):
        """One step of a batch: obs [B, *obs_shape], starts [B] -> (memory, policy [B],
        value [B])."""
        memory, pi, value = self(memory, obs[None], starts[None])
        return memory, jax.tree.map(lambda x: x[0], pi), value[0]


def make_network(config: Config, spec) -> ActorCritic | RecurrentActorCritic:
    """The actor-critic of this config for an env of this `EnvSpec`."""
    sizes = (spec.num_actions, spec.discrete, len(spec.obs_shape), config.hidden_size)
    if config.memory == "gru":  # actor and critic always share its torso and GRU
        return RecurrentActorCritic(*sizes, config.activation, config.torso)
    return ActorCritic(*sizes, config.activation, config.torso, config.shared_torso)


# ---------------------------------------------------------------------------------------------
# Running statistics: --normalize-obs and --normalize-reward
# ---------------------------------------------------------------------------------------------


class RunningStats(NamedTuple):
    """Count, mean and population variance of every value seen so far."""

    count: jax.Array  # []
    mean: jax.Array  # [*shape]
    var: jax.Array  # [*shape]


def initial_stats(shape) -> RunningStats:
    # As gym's RunningMeanStd: mean 0, variance 1 and a tiny count, so that the first batch all
    # but replaces them and nothing divides by zero.
    return RunningStats(jnp.float32(1e-4), jnp.zeros(shape), jnp.ones(shape))


def merge_stats(a: RunningStats, b: RunningStats) -> RunningStats:
    """The statistics of two disjoint sets of values together (Chan et al.'s parallel merge)."""
    count = a.count + b.count
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.count / count)
    sum_sq = a.var * a.count + b.var * b.count + delta**2 * (a.count * b.count / count)
    return RunningStats(count, mean, sum_sq / count)


def batch_stats(x) -> RunningStats:
    """The statistics of a batch x [B, *shape] on every device together, the same on each: a
    two-pass mean and variance over all devices' values. Call it inside the driver's pmap."""
    count = device_sum(jnp.float32(x.shape[0]))
    mean = device_sum(x.sum(0)) / count
    return RunningStats(count, mean, device_sum(((x - mean) ** 2).sum(0)) / count)


def normalize(stats: RunningStats, x, clip: float = 10.0):
    """x scaled to zero mean and unit variance by `stats`, clipped to +-clip (CleanRL's 10)."""
    return jnp.clip((x - stats.mean) / jnp.sqrt(stats.var + 1e-8), -clip, clip)


class Normalizer(NamedTuple):
    """What --normalize-obs and --normalize-reward keep: CleanRL's and PureJaxRL's wrappers,
    held in the training state. One set per seed, merged over devices; without the flags it
    is never updated or used."""

    obs: RunningStats  # of every observation the environments returned, [*obs_shape]
    returns: RunningStats  # of the discounted returns below, []
    discounted_return: jax.Array  # [E] discounted reward sum of each env's running episode


# ---------------------------------------------------------------------------------------------
# Targets and loss
# ---------------------------------------------------------------------------------------------


def next_state_values(values, last_value, final_values, truncated):
    """Value of the state each step led to, arrays [T, N] (`last_value` [N]).

    Normally that is the next rollout state's value. After an automatic reset the next rollout
    state belongs to a new episode, so a time-limit truncation uses the value of the final
    observation it was cut off in instead (an episode that terminated gets no bootstrap at all,
    which `compute_gae` applies).
    """
    following = jnp.concatenate([values[1:], last_value[None]])
    return jnp.where(truncated > 0, final_values, following)


def compute_gae(rewards, values, next_values, terminated, dones, gamma, gae_lambda):
    """Generalised advantage estimation over a rollout, arrays [T, N].

    `next_values[t]` is the value of the state that followed step t: the next rollout state, or,
    where the episode was truncated by a time limit, the state it was cut off in (its final
    observation). Only `terminated` zeroes that bootstrap; any episode end (`dones`) stops the
    advantage from flowing back across the reset. Returns (advantages, value targets).
    """
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values

    def _backward_step(next_advantage, step):
        delta, done = step
        advantage = delta + gamma * gae_lambda * (1.0 - done) * next_advantage
        return advantage, advantage

    # Off the CPU, unrolled 16 steps per loop iteration as PureJaxRL's GAE: there every
    # iteration of a loop costs a launch and a check of its condition, and this body is one
    # multiply-add. On the CPU unrolling only lengthens the compilation (docs/benchmarks.md).
    unroll = 1 if jax.default_backend() == "cpu" else 16
    _, advantages = jax.lax.scan(
        _backward_step, jnp.zeros_like(values[0]), (deltas, dones), reverse=True, unroll=unroll
    )
    return advantages, advantages + values


class LossInfo(NamedTuple):
    policy_loss: jax.Array
    value_loss: jax.Array
    entropy: jax.Array
    approx_kl: jax.Array
    clip_frac: jax.Array


def ppo_loss(
    log_prob,
    entropy,
    value,
    old_log_prob,
    old_value,
    advantages,
    targets,
    *,
    hp: HyperParams,
    norm_adv: bool,
    clip_vloss: bool,
):
    """Clipped-surrogate PPO loss on one minibatch (all arrays [B]); returns (loss, LossInfo)."""
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    policy_loss = jnp.maximum(
        -advantages * ratio, -advantages * jnp.clip(ratio, 1.0 - hp.clip_coef, 1.0 + hp.clip_coef)
    ).mean()
    value_loss = (value - targets) ** 2
    if clip_vloss:
        value_clipped = old_value + jnp.clip(value - old_value, -hp.clip_coef, hp.clip_coef)
        value_loss = jnp.maximum(value_loss, (value_clipped - targets) ** 2)
    value_loss = 0.5 * value_loss.mean()
    entropy = entropy.mean()
    loss = policy_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy
    info = LossInfo(
        policy_loss=policy_loss,
        value_loss=value_loss,
        entropy=entropy,
        # k3 estimator of KL(old || new) and share of clipped ratios: diagnostics only
        approx_kl=((ratio - 1.0) - log_ratio).mean(),
        clip_frac=(jnp.abs(ratio - 1.0) > hp.clip_coef).mean(),
    )
    return loss, info


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------


# Shapes: every function below sees one seed on one device, where E = num_envs / devices
# environments step side by side and T = num_steps; a rollout's leaves are [T, E, ...].


class Transition(NamedTuple):
    """One step of every environment; stacked by the rollout's scan into [T, E, ...]. With
    --normalize-obs the observations are normalised and with --normalize-reward the reward is
    scaled, as the agent learns from them."""

    obs: jax.Array  # [E, obs_size] the observation acted on, flattened (see `stored`)
    start: jax.Array  # [E] bool, True where obs is the first observation of its episode
    action: jax.Array  # [E] int (discrete) or [E, action_dim] float (continuous)
    log_prob: jax.Array  # [E] of the action under the acting policy
    value: jax.Array  # [E] critic's value of obs
    reward: jax.Array  # [E]
    terminated: jax.Array  # [E] 1.0 where the episode ended in a terminal state
    truncated: jax.Array  # [E] 1.0 where a time limit cut the episode off
    final_value: jax.Array  # [E] value of the observation a truncated step ended in (else 0.0)
    episode_return: jax.Array  # [E] return of the episode that ended here (where done)
    episode_length: jax.Array  # [E]
    episode_stats: dict  # {name: [E]} the env family's extra statistics of that episode


class TruncationSlot(NamedTuple):
    """Where a rollout is no longer than the time limit, an environment's episode is cut off at
    most once in it: the observation it was cut off in, kept until the rollout's end (zeros
    where none was)."""

    obs: jax.Array  # [E, obs_size] as the agent saw it, flattened (see `stored`)
    memory: jax.Array  # [E, H] the memory after that step (or ())


class RunnerState(NamedTuple):
    params: dict  # the actor-critic's parameters, the same on every device
    opt_state: optax.OptState
    hparams: HyperParams  # scalars: this run's swept values
    env_state: object  # leaves [E, ...]
    obs: jax.Array  # [E, *obs_shape] the observation of the next step
    starts: jax.Array  # [E] bool, True where obs is the first observation of its episode
    memory: jax.Array  # [E, H] the memory after the last step, reset where starts (or ())
    normalizer: Normalizer
    key: jax.Array


def rollout_targets(traj: Transition, last_value, gamma, gae_lambda):
    """GAE advantages and value targets of a rollout, [T, E]. `last_value` [E] is the value of
    the observation after the rollout, the bootstrap of its last step; `traj.final_value` holds
    those of its truncated steps."""
    next_values = next_state_values(traj.value, last_value, traj.final_value, traj.truncated)
    dones = jnp.maximum(traj.terminated, traj.truncated)
    return compute_gae(
        traj.reward, traj.value, next_values, traj.terminated, dones, gamma, gae_lambda
    )


def validate(config: Config, runtime: Runtime) -> None:
    """ConfigError for a config that cannot train; cheap enough to run per sweep configuration."""
    spec = env_spec(config.env)
    # the number of updates is computed from it on the host; no step counter holds it
    require_positive(config, "total_timesteps", maximum=None)
    require_positive(
        config, "num_envs", "num_steps", "num_minibatches", "update_epochs", "hidden_size"
    )
    require_positive(config, "eval_episodes", minimum=0)
    require_in(config, "learning_rate", 0.0, 1.0, above_low=True)
    for name in ("gamma", "gae_lambda"):
        require_in(config, name, 0.0, 1.0)
    for name in ("clip_coef", "ent_coef", "vf_coef", "max_grad_norm"):
        require_in(config, name, 0.0)
    if config.num_envs % runtime.num_devices:
        raise ConfigError(
            f"--num-envs {config.num_envs} is not divisible by the {runtime.num_devices} devices"
        )
    envs_per_device = config.num_envs // runtime.num_devices
    batch_size = envs_per_device * config.num_steps
    if batch_size % config.num_minibatches:
        raise ConfigError(
            f"the rollout batch per device ({envs_per_device} envs x {config.num_steps} steps = "
            f"{batch_size}) is not divisible by --num-minibatches {config.num_minibatches}"
        )
    if config.memory != "none" and envs_per_device % config.num_minibatches:
        raise ConfigError(
            f"--memory {config.memory} keeps each environment's sequence whole, so the "
            f"{envs_per_device} envs per device must be divisible by --num-minibatches "
            f"{config.num_minibatches}"
        )
    steps_per_update = config.num_envs * config.num_steps
    if config.total_timesteps < steps_per_update:
        raise ConfigError(
            f"--total-timesteps {config.total_timesteps} is less than one update "
            f"(--num-envs x --num-steps = {steps_per_update})"
        )
    if config.torso == "cnn" and len(spec.obs_shape) != 3:
        raise ConfigError(
            f"--torso cnn needs image observations; {spec.env_id} has shape {spec.obs_shape}"
        )


def make_train(config: Config, runtime: Runtime | None = None) -> Trainer:
    """Build the pure training functions of a valid config (nothing is compiled here); without
    a runtime, for one run on one device."""
    runtime = runtime or Runtime()
    env, env_params, spec = make_env(config.env)
    envs_per_device = config.num_envs // runtime.num_devices
    batch_size = envs_per_device * config.num_steps  # per device
    steps_per_update = config.num_envs * config.num_steps
    num_updates = config.total_timesteps // steps_per_update
    minibatch_size = batch_size // config.num_minibatches
    num_optimizer_steps = num_updates * config.update_epochs * config.num_minibatches
    network = make_network(config, spec)
    recurrent = config.memory != "none"

    def initial_memory(batch_size):
        """The memory of a batch before its first step: the GRU's zero carry [B, H], or ()."""
        return jnp.zeros((batch_size, config.hidden_size)) if recurrent else ()

    def forward(params, memory, obs, starts):
        """(memory, policy, value) of observations: for --memory a sequence obs [T, B, ...] with
        starts [T, B] from memory [B, H]; otherwise a batch of any shape (memory passes by)."""
        if recurrent:
            return network.apply(params, memory, obs, starts)
        return (memory, *network.apply(params, obs))

    def policy_step(params, memory, obs, starts):
        """(memory, policy, value) of one step of a batch: obs [B, ...], starts [B]."""
        if recurrent:
            return network.apply(params, memory, obs, starts, method=RecurrentActorCritic.step)
        return forward(params, memory, obs, starts)

    def continuation_value(params, memory, obs):
        """Values [E] of observations obs [E, ...] that go on with the episode of the step before
        them, whose memory after it is memory [E, H] (or ())."""
        if not recurrent:
            return network.apply(params, obs, method=ActorCritic.value)
        return policy_step(params, memory, obs, jnp.zeros(obs.shape[0], bool))[2]

    # A rollout keeps its observations flattened, [T, E, obs_size], as PureJaxRL's flattening
    # wrapper gives them: a TPU lays out an array's last two dimensions in tiles of 8 x 128, so
    # a MinAtar observation [10, 10, 4] stored as it is would take 51 times its size.
    def stored(obs):
        """Observations [E, *obs_shape] as a rollout keeps them, [E, obs_size]."""
        return obs.reshape(obs.shape[0], -1)

    def unstored(obs):
        """Stored observations [..., obs_size] in their env shape, [..., *obs_shape]."""
        return obs.reshape(*obs.shape[:-1], *spec.obs_shape)

    # A time limit cuts an episode off at its max_episode_steps-th step, so an environment
    # truncates at most once in any max_episode_steps steps. Where a rollout is no longer than
    # that, it keeps each environment's truncation (`TruncationSlot`) and values them all in
    # one pass after the rollout; otherwise every step values its own.
    value_after_rollout = spec.max_episode_steps >= config.num_steps

    def truncation_values(params, memory, final_obs, truncated):
        """The bootstrap values [E] of one step's time-limit truncations: the value of the
        observation an episode was cut off in (final_obs [E, ...], as the agent sees it), and
        0.0 where it was not."""
        return jnp.where(truncated, continuation_value(params, memory, final_obs), 0.0)

    def kept_truncations(slot: TruncationSlot, memory, final_obs, truncated) -> TruncationSlot:
        """The slot with one step's truncations (truncated [E]) in place of what it held for
        those environments."""

        def keep(new, old):
            return jnp.where(truncated.reshape(-1, *(1,) * (new.ndim - 1)), new, old)

        return TruncationSlot(
            keep(stored(final_obs), slot.obs), jax.tree.map(keep, memory, slot.memory)
        )

    def slot_values(params, slot: TruncationSlot, truncated):
        """A rollout's bootstrap values of its truncations [T, E] (truncated [T, E]), as
        `truncation_values` gives them step by step, in one pass over the slot's observations."""
        values = continuation_value(params, slot.memory, unstored(slot.obs))
        return jnp.where(truncated > 0, values, 0.0)

    def seen(normalizer: Normalizer, obs):
        """Observations [E, ...] as the agent sees them under the current statistics."""
        return normalize(normalizer.obs, obs) if config.normalize_obs else obs

    # As CleanRL's wrappers do, the statistics first take in what the environments returned
    # (observations, not final observations; discounted returns), then scale it.
    def observe(normalizer: Normalizer, obs):
        """The statistics updated with a step's observations [E, ...], and those observations
        as the agent sees them."""
        if not config.normalize_obs:
            return normalizer, obs
        normalizer = normalizer._replace(obs=merge_stats(normalizer.obs, batch_stats(obs)))
        return normalizer, seen(normalizer, obs)

    def scale_reward(normalizer: Normalizer, reward, starts, gamma):
        """A step's rewards [E] as the agent learns from them; `starts` [E] marks the envs
        whose step began an episode, where the discounted return starts again."""
        if not config.normalize_reward:
            return normalizer, reward
        discounted = reward + gamma * normalizer.discounted_return * (1.0 - starts)
        return_stats = merge_stats(normalizer.returns, batch_stats(discounted))
        reward = jnp.clip(reward / jnp.sqrt(return_stats.var + 1e-8), -10.0, 10.0)
        return normalizer._replace(returns=return_stats, discounted_return=discounted), reward

    def to_env_action(action):
        return action if spec.discrete else jnp.clip(action, spec.action_low, spec.action_high)

    def make_optimizer(hp: HyperParams):
        learning_rate = hp.learning_rate
        if config.anneal_lr:  # optax counts optimiser steps, so this decays at every step

            def learning_rate(count):
                return hp.learning_rate * (1.0 - count / num_optimizer_steps)

        # 0 means no clipping (as in DQN), not a zero threshold that would stop all learning;
        # an infinite threshold never clips, so the switch stays inside the program.
        max_norm = jnp.where(hp.max_grad_norm > 0, hp.max_grad_norm, jnp.inf)
        # On the parameters as one flat vector (optax.flatten): the same Adam arithmetic per
        # element in a few kernels instead of several per array, which compiles faster.
        return optax.flatten(
            optax.chain(optax.clip_by_global_norm(max_norm), optax.adam(learning_rate, eps=1e-5))
        )

    def init(key, hp: HyperParams) -> RunnerState:
        init_key, env_key = jax.random.split(key)
        # Same parameters on every device; environments and sampling differ per device.
        env_key = jax.random.fold_in(env_key, jax.lax.axis_index(DEVICE_AXIS))
        reset_key, run_key = jax.random.split(env_key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(reset_key, envs_per_device), env_params
        )
        starts = jnp.ones(envs_per_device, bool)
        memory = initial_memory(envs_per_device)
        normalizer = Normalizer(
            initial_stats(spec.obs_shape), initial_stats(()), jnp.zeros(envs_per_device)
        )
        normalizer, obs = observe(normalizer, obs)
        if recurrent:
            params = network.init(init_key, memory, obs[None], starts[None])
        else:
            params = network.init(init_key, obs)
        opt_state = make_optimizer(hp).init(params)
        return RunnerState(
            params, opt_state, hp, env_state, obs, starts, memory, normalizer, run_key
        )

    def whole_sequence_minibatches(key, b_memory, b_rollout):
        """--memory: the rollout split over shuffled environments, each keeping its whole
        sequence and its memory before it: memory [num_minibatches, E / num_minibatches, H] and
        rollout leaves [num_minibatches, T, E / num_minibatches, ...]."""
        permutation = jax.random.permutation(key, envs_per_device)

        def split(x, env_axis):
            x = jnp.take(x, permutation, axis=env_axis)
            shape = (config.num_minibatches, envs_per_device // config.num_minibatches)
            x = x.reshape(*x.shape[:env_axis], *shape, *x.shape[env_axis + 1 :])
            return jnp.moveaxis(x, env_axis, 0)

        return split(b_memory, 0), jax.tree.map(lambda x: split(x, 1), b_rollout)

    def _update_step(runner_state: RunnerState, _):
        hp = runner_state.hparams
        optimizer = make_optimizer(hp)

        # 1. Rollout: num_steps steps of every environment with the current policy.
        def _env_step(carry: tuple[RunnerState, TruncationSlot | None], _):
            runner_state, slot = carry
            key, action_key, step_key = jax.random.split(runner_state.key, 3)
            memory, pi, value = policy_step(
                runner_state.params, runner_state.memory, runner_state.obs, runner_state.starts
            )
            action = pi.sample(action_key)
            obs, env_state, reward, terminated, truncated, info = jax.vmap(
                env.step, in_axes=(0, 0, 0, None)
            )(
                jax.random.split(step_key, envs_per_device),
                runner_state.env_state,
                to_env_action(action),
                env_params,
            )
            normalizer, obs = observe(runner_state.normalizer, obs)
            final_obs = seen(normalizer, info["final_observation"])
            if value_after_rollout:
                slot = kept_truncations(slot, memory, final_obs, truncated)
                final_value = jnp.zeros(envs_per_device)  # valued after the rollout
            else:
                final_value = truncation_values(runner_state.params, memory, final_obs, truncated)
            normalizer, reward = scale_reward(normalizer, reward, runner_state.starts, hp.gamma)
            transition = Transition(
                stored(runner_state.obs),
                runner_state.starts,
                action,
                pi.log_prob(action),
                value,
                reward,
                terminated.astype(jnp.float32),
                truncated.astype(jnp.float32),
                final_value,
                info["episode_return"],
                info["episode_length"],
                info["episode_stats"],
            )
            # gymnax resets an env whose episode ended, so its next observation starts one.
            runner_state = runner_state._replace(
                env_state=env_state,
                obs=obs,
                starts=terminated | truncated,
                memory=memory,
                normalizer=normalizer,
                key=key,
            )
            return (runner_state, slot), transition

        rollout_memory = runner_state.memory  # [E, H] each sequence's memory before its start
        slot = None  # without `value_after_rollout` each step values its own truncations
        if value_after_rollout:
            slot = TruncationSlot(jnp.zeros_like(stored(runner_state.obs)), rollout_memory)
        (runner_state, slot), traj = jax.lax.scan(
            _env_step, (runner_state, slot), None, config.num_steps
        )

        # 2. Targets: the rollout's last step bootstraps from the value of the observation after
        # it, a time-limit truncation from the value of the observation it was cut off in.
        if value_after_rollout:
            final_value = slot_values(runner_state.params, slot, traj.truncated)
            traj = traj._replace(final_value=final_value)
        _, _, last_value = policy_step(
            runner_state.params, runner_state.memory, runner_state.obs, runner_state.starts
        )
        advantages, targets = rollout_targets(traj, last_value, hp.gamma, hp.gae_lambda)

        # 3. Learn: epochs x shuffled minibatches, gradients averaged over devices.
        def _update_epoch(carry, _):
            def _update_minibatch(carry, minibatch):
                params, opt_state = carry
                mb_memory, (mb_traj, mb_advantages, mb_targets) = minibatch

                def _loss(params):
                    mb_obs = unstored(mb_traj.obs)
                    _, pi, value = forward(params, mb_memory, mb_obs, mb_traj.start)
                    return ppo_loss(
                        pi.log_prob(mb_traj.action),
                        pi.entropy(),
                        value,
                        mb_traj.log_prob,
                        mb_traj.value,
                        mb_advantages,
                        mb_targets,
                        hp=hp,
                        norm_adv=config.norm_adv,
                        clip_vloss=config.clip_vloss,
                    )

                grads, info = jax.grad(_loss, has_aux=True)(params)
                grads = device_mean(grads)
                updates, opt_state = optimizer.update(grads, opt_state, params)
                return (optax.apply_updates(params, updates), opt_state), info

            params, opt_state, key = carry
            key, permutation_key = jax.random.split(key)
            b_rollout = (traj, advantages, targets)
            if recurrent:
                minibatches = whole_sequence_minibatches(permutation_key, rollout_memory, b_rollout)
            else:
                # The rollout as one batch of T x E steps, shuffled into [num_minibatches, M, ...].
                permutation = jax.random.permutation(permutation_key, batch_size)
                minibatches = (
                    None,
                    jax.tree.map(
                        lambda x: x.reshape(batch_size, *x.shape[2:])[permutation].reshape(
                            config.num_minibatches, minibatch_size, *x.shape[2:]
                        ),
                        b_rollout,
                    ),
                )
            (params, opt_state), info = jax.lax.scan(
                _update_minibatch, (params, opt_state), minibatches
            )
            return (params, opt_state, key), info

        (params, opt_state, key), info = jax.lax.scan(
            _update_epoch,
            (runner_state.params, runner_state.opt_state, runner_state.key),
            None,
            config.update_epochs,
        )
        runner_state = runner_state._replace(params=params, opt_state=opt_state, key=key)

        # 4. Metrics, reduced here so nothing per-step is kept: episodes that ended this update.
        ended = jnp.logical_or(traj.terminated, traj.truncated)
        metrics = {
            **episode_metrics(ended, traj.episode_return, traj.episode_length, traj.episode_stats),
            **{k: device_mean(v.mean()) for k, v in info._asdict().items()},
        }
        return runner_state, metrics

    def train_chunk(runner_state: RunnerState, num_updates: int, num_active=None):
        return scan_updates(_update_step, runner_state, num_updates, num_active)

    def greedy_policy(runner_state: RunnerState) -> Policy:
        """The most likely action, on observations normalised by the statistics training ended
        with (frozen)."""

        def act(obs, memory):
            obs = seen(runner_state.normalizer, obs)
            starts = jnp.zeros(obs.shape[0], bool)  # the memory starts at zero instead
            memory, pi, _ = policy_step(runner_state.params, memory, obs, starts)
            return to_env_action(pi.mode()), memory

        return Policy(act, initial_memory)

    def evaluate(runner_state: RunnerState, key):
        return evaluate_policy(
            env,
            env_params,
            greedy_policy(runner_state),
            key,
            config.eval_episodes,
            spec.max_episode_steps,
        )

    return Trainer(
        algo="ppo",
        env_id=spec.env_id,
        num_updates=num_updates,
        steps_per_update=steps_per_update,
        hyperparams=hyperparams_of(HyperParams, config),
        init=init,
        train_chunk=train_chunk,
        evaluate=evaluate if config.eval_episodes else None,
        runtime=runtime,
        video_policy=greedy_policy if config.capture_video else None,
        guarded_metrics=("policy_loss", "value_loss"),
        guarded_state=lambda runner_state: (runner_state.params, runner_state.opt_state),
    )


def main() -> None:
    """The command line: parse the flags, then train."""
    with exit_on_config_error():
        run_training(parse_config(Config, PRESETS), make_train, validate)


if __name__ == "__main__":
    main()
