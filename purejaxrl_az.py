"""AlphaZero for two-player board games from pgx: self-play with MCTS (mctx), value and policy
targets, an on-device replay buffer, SGD and evaluation, all in one compiled JAX program.

    python purejaxrl_az.py --env tic_tac_toe          # near-perfect play by iteration 30 of 100
    python purejaxrl_az.py --env connect_four --cpu-devices 2
    python purejaxrl_az.py --env othello --search puct --temperature 1.0

The pgx environment is the search's perfect model: `recurrent_fn` steps the real game. Gumbel
MuZero's policy improvement (Danihelka et al., 2022) is the default search, since it improves the
policy even with few simulations; `--search puct` is AlphaZero's PUCT with Dirichlet noise.

Read top to bottom: Config and per-game presets, the supported games and their board
symmetries, the network, the pure pieces (masked priors, search, value targets, replay buffer,
loss), the stages, then `make_train`, which binds them to the run's settings. One AlphaZero
iteration (`iterate`): `selfplay` (every game plays `rollout_steps` searched moves) ->
`add_to_buffer` (value targets are recomputed over the buffer) -> `learn`
(`updates_per_iteration` SGD steps). Every `eval_every` iterations the chunk ends with
`evaluate`: greedy-search games against a random player, a plain MCTS player and, for
tic_tac_toe, a perfect minimax player (utils/board_eval.py).

Shapes: every stage runs under the driver's `pmap(vmap(...))` and sees one seed on one device:
G = num_games / devices games, T = rollout_steps moves per window, rows = buffer_size //
num_games moves kept of each game, B = minibatch_size / devices positions per SGD step, and
eval_games / devices evaluation games.

Conventions for two-player zero-sum games, as pgx defines them: players alternate (a pass is a
move), `state.rewards[p]` is player p's reward, observations are from the mover's side. The
search therefore uses discount -1 between plies, rewards from the mover's perspective, and
value 0 with discount 0 at and past the end of a game.
"""

from __future__ import annotations

# First of all: from here on a Ctrl-C, even during the slow imports below, exits with one line.
import utils.interrupts  # noqa: F401  # isort: skip

import dataclasses
import functools
import sys
from typing import Literal, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import mctx
import numpy as np
import optax
import pgx

from utils import board_play
from utils.board_eval import evaluate_agent, opponents, solve_tic_tac_toe, write_game_records
from utils.cli import RunConfig, exit_on_config_error, parse_config, require_in, require_positive
from utils.devices import DEVICE_AXIS, device_mean, device_sum
from utils.driver import run_training
from utils.errors import ConfigError
from utils.layers import Conv3x3
from utils.trainer import Runtime, Trainer, hyperparams_of


@dataclasses.dataclass
class Config(RunConfig):
    """AlphaZero (Gumbel MuZero search by default) on pgx two-player board games, compiled end to
    end with JAX. A trained run plays you with --play RUN_DIR, another run with --arena RUN_A
    RUN_B (their flags: --play X --help)."""

    env: str = "tic_tac_toe"
    """pgx game id: tic_tac_toe, connect_four, othello, hex, go_9x9, go_19x19, animal_shogi,
    gardner_chess, chess, shogi. Each game has its own preset defaults"""
    num_iterations: int = 100
    """AlphaZero iterations (self-play window + SGD steps) per seed"""
    num_games: int = 256
    """games played side by side per seed, split across devices; unfinished games carry over
    to the next iteration"""
    rollout_steps: int = 16
    """moves every game makes per iteration"""
    buffer_size: int = 16_384
    """replay buffer size in positions per seed (rounded down to a multiple of --num-games)"""
    updates_per_iteration: int = 8
    """SGD steps per iteration"""
    minibatch_size: int = 512
    """positions per SGD step (all devices together), sampled uniformly from the buffer's
    positions that have a value target"""
    learning_rate: float = 1e-3
    """Adam learning rate"""
    weight_decay: float = 1e-4
    """L2 penalty on all parameters, added to the loss (AlphaZero's c)"""
    num_blocks: int = 2
    """residual blocks of the ResNet"""
    num_channels: int = 32
    """channels of every convolution"""
    batch_norm: bool = True
    """BatchNorm in the ResNet (running statistics are used for search, batch ones in SGD)"""
    search: Literal["gumbel", "puct"] = "gumbel"
    """gumbel: Gumbel MuZero policy (sequential halving, improved-policy targets); puct:
    AlphaZero's PUCT (Dirichlet noise at the root, visit-count targets)"""
    num_simulations: int = 32
    """MCTS simulations per move in self-play and for the agent in evaluation"""
    max_num_considered_actions: int = 16
    """gumbel: actions sampled at the root for sequential halving"""
    gumbel_scale: float = 1.0
    """gumbel: scale of the Gumbel noise that explores in self-play (0 is greedy)"""
    temperature: float = 1.0
    """puct: self-play moves are sampled from visit counts ** (1 / temperature)"""
    dirichlet_alpha: float = 0.3
    """puct: Dirichlet noise concentration at the root"""
    dirichlet_fraction: float = 0.25
    """puct: share of Dirichlet noise in the root prior"""
    value_target: Literal["outcome", "td-lambda"] = "outcome"
    """outcome: the game's final result for the player to move (AlphaZero); td-lambda: the
    lambda-return of rewards and the search values of later positions"""
    td_lambda: float = 0.9
    """td-lambda: weight of longer returns (1: the outcome, bootstrapping only at the buffer's
    newest position; 0: one ply and the next position's search value)"""
    augment: bool = True
    """train on a random board symmetry of each position (connect_four: mirror; tic_tac_toe,
    othello, go: the 8 rotations and reflections; hex: 180-degree rotation; none for chess-like
    games)"""
    eval_every: int = 10
    """iterations between evaluations; a compiled chunk ends with one, so logging and
    checkpoints happen at the same points"""
    eval_games: int = 64
    """evaluation games per opponent, half with the agent moving first (0: no evaluation)"""
    baseline_sims: int = 64
    """simulations of the plain MCTS opponent (uniform priors, random-rollout values)"""
    cpu_devices: int = 0
    """on a CPU-only host, split the CPU into this many XLA devices, games split over them
    (-1: one per core, the fastest for self-play, and the command line's default; 0: JAX's
    single CPU device, the default of a Config built in Python). Ignored on GPU/TPU hosts"""
    record_games: bool = False
    """at each evaluation, write one game per opponent and seat as an SVG animation (pgx's
    renderer) into RUN_DIR/games/ (and wandb with --track)"""


# Defaults per game; any flag overrides them. Small games get a small network and many games
# at once; docs/benchmarks.md measures self-play at these. tic_tac_toe plays 128 games, keeps
# 32 iterations of them, and explores with twice the Gumbel noise: at scale 1 self-play
# settles on the prior's favourite among equally good moves, and the positions the minimax
# player steers into are never trained on. The runs behind this: docs/alphazero.md, "Results".
PRESETS = {
    "tic_tac_toe": dict(num_games=128, buffer_size=65_536, gumbel_scale=2.0),
    "connect_four": dict(
        num_iterations=300,
        num_games=128,
        rollout_steps=32,
        buffer_size=32_768,
        eval_every=20,
    ),
    **{
        game: dict(
            num_iterations=300,
            num_games=128,
            rollout_steps=32,
            buffer_size=65_536,
            num_blocks=4,
            num_channels=64,
            eval_every=20,
            eval_games=32,
        )
        for game in ("othello", "hex", "go_9x9", "animal_shogi", "gardner_chess")
    },
}


class HyperParams(NamedTuple):
    """Hyperparameters that change no array shape. They travel in the training state as
    arrays rather than being baked into the program as constants."""

    learning_rate: jax.Array
    weight_decay: jax.Array
    gumbel_scale: jax.Array
    temperature: jax.Array
    dirichlet_alpha: jax.Array
    dirichlet_fraction: jax.Array
    td_lambda: jax.Array


# ---------------------------------------------------------------------------------------------
# Games and their board symmetries
# ---------------------------------------------------------------------------------------------

# Two-player, zero-sum, perfect-information, deterministic: the games where the pgx simulator
# can be the search's model and players alternate.
SUPPORTED_GAMES = (
    "tic_tac_toe",
    "connect_four",
    "othello",
    "hex",
    "go_9x9",
    "go_19x19",
    "animal_shogi",
    "gardner_chess",
    "chess",
    "shogi",
)


def resolve_game(name: str) -> str:
    """The pgx id of a supported game (any case, '-' for '_'), or a ConfigError listing them."""
    game = name.lower().replace("-", "_")
    if game in SUPPORTED_GAMES:
        return game
    reason = (
        " (a pgx game, but not a two-player deterministic perfect-information one, which this "
        "AlphaZero needs)"
        if game in pgx.available_envs()
        else ""
    )
    raise ConfigError(f"unknown game {name!r}{reason}; valid games: {', '.join(SUPPORTED_GAMES)}")


def _dihedral(x, k: int):
    """The k-th of the 8 rotations/reflections of the board in axes (0, 1) of x."""
    x = jnp.rot90(x, k % 4, axes=(0, 1))
    return jnp.swapaxes(x, 0, 1) if k >= 4 else x


# Per game: the board transforms (functions on arrays whose first two axes are the board) and
# the shape of the grid that board actions index in row-major order; actions past the grid
# (pass, swap) are fixed by every symmetry.
SYMMETRIES = {
    "tic_tac_toe": ([functools.partial(_dihedral, k=k) for k in range(8)], (3, 3)),
    "othello": ([functools.partial(_dihedral, k=k) for k in range(8)], (8, 8)),
    "go_9x9": ([functools.partial(_dihedral, k=k) for k in range(8)], (9, 9)),
    "go_19x19": ([functools.partial(_dihedral, k=k) for k in range(8)], (19, 19)),
    # Gravity: only the left-right mirror. Actions are columns, a 1-row grid.
    "connect_four": ([lambda x: x, lambda x: jnp.flip(x, 1)], (1, 7)),
    # Each player's two edges stay theirs only under the half turn.
    "hex": ([lambda x: x, functools.partial(_dihedral, k=2)], (11, 11)),
}


def action_permutations(game: str, num_actions: int) -> np.ndarray:
    """[num_symmetries, num_actions] int: under symmetry k, new_policy = policy[perm[k]]. The
    transform moves board cells, so the grid of cell indices, transformed, says for every new
    cell which old cell it came from."""
    transforms, grid_shape = SYMMETRIES.get(game, ([lambda x: x], None))
    if grid_shape is None:
        return np.arange(num_actions)[None]
    num_cells = grid_shape[0] * grid_shape[1]
    grid = jnp.arange(num_cells).reshape(grid_shape)
    extra = np.arange(num_cells, num_actions)
    return np.stack([np.concatenate([np.asarray(t(grid)).ravel(), extra]) for t in transforms])


def augment_position(game: str, perms: np.ndarray, k, obs, legal, policy):
    """Symmetry k (traced) applied consistently to one position's observation, legal mask and
    policy target."""
    transforms, _ = SYMMETRIES.get(game, ([lambda x: x], None))
    obs = jax.lax.switch(k, transforms, obs)
    perm = jnp.asarray(perms)[k]
    return obs, legal[perm], policy[perm]


# ---------------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------------


class ResNet(nn.Module):
    """AlphaZero's network, pre-activation (v2) residual blocks: 3x3 conv stem, blocks of
    (norm, relu, conv) x 2, then a policy head (1x1 conv to 2 channels, dense to logits) and a
    tanh value head (1x1 conv to 1 channel, dense, dense to 1). 1x1 convs are Dense layers;
    3x3 ones are `Conv3x3` (utils/layers.py), nn.Conv computed the way that is fastest here."""

    num_actions: int
    num_blocks: int
    num_channels: int
    batch_norm: bool
    conv_method: str = "matmul"  # see utils/layers.py and make_networks

    @nn.compact
    def __call__(self, obs, train: bool = False):
        def norm(x):
            if not self.batch_norm:
                return x
            return nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)

        def conv(x):
            return Conv3x3(self.num_channels, self.conv_method)(x)

        x = conv(obs.astype(jnp.float32))
        for _ in range(self.num_blocks):
            x = x + conv(nn.relu(norm(conv(nn.relu(norm(x))))))
        x = nn.relu(norm(x))
        batch_shape = x.shape[:-3]

        policy = nn.relu(norm(nn.Dense(2)(x)))
        logits = nn.Dense(self.num_actions)(policy.reshape(*batch_shape, -1))

        value = nn.relu(norm(nn.Dense(1)(x)))
        value = nn.relu(nn.Dense(self.num_channels)(value.reshape(*batch_shape, -1)))
        value = jnp.tanh(nn.Dense(1)(value))[..., 0]
        return logits, value


def make_networks(config: Config, env, *, one_run: bool) -> tuple[ResNet, ResNet]:
    """The ResNet for search and the same one for SGD (`learner`): one set of parameters,
    several ways to compute its convolutions (utils/layers.py). On boards of at most 3x3
    (tic_tac_toe) one dense matmul over the whole board does the convolution's own arithmetic,
    fastest for search and SGD alike. On larger boards, with one run, search runs XLA's
    convolution, faster for a forward pass; SGD, and all of it with vmapped seeds or sweep
    configurations (`one_run` False), the matmul form, since XLA's convolution gradient in a
    loop and its convolution with batched parameters are slow on CPU (docs/benchmarks.md)."""
    small_board = max(env.observation_shape[:2]) <= 3
    network = ResNet(
        env.num_actions,
        config.num_blocks,
        config.num_channels,
        config.batch_norm,
        conv_method="dense" if small_board else "xla" if one_run else "matmul",
    )
    return network, network.clone(conv_method="dense" if small_board else "matmul")


# ---------------------------------------------------------------------------------------------
# Pure pieces: priors, search, value targets, replay buffer, loss
# ---------------------------------------------------------------------------------------------

ILLEGAL_LOGIT = (
    -1e9
)  # exp() of it is exactly 0 in float32, and no -inf reaches a gradient; the best legal logit is 0


def masked_logits(logits, legal):
    """Logits with illegal actions at ILLEGAL_LOGIT. This is the only place priors are masked,
    and they stay logits: mctx applies the one softmax."""
    logits = jnp.where(legal, logits, ILLEGAL_LOGIT)
    return jnp.where(legal, logits - jnp.max(logits, axis=-1, keepdims=True), ILLEGAL_LOGIT)


def make_recurrent_fn(env, evaluate_position):
    """mctx's model step with the real game: `evaluate_position(params, key, state) -> (logits,
    value)` values the position after the move from the new mover's side. Reward is the mover's;
    discount -1 between the two players; at and past the end of a game value 0 and discount 0,
    so nothing behind a finished game reaches the search's values (pgx leaves a finished state
    unchanged with zero rewards)."""

    def recurrent_fn(params, key, action, state):
        mover = state.current_player
        state = jax.vmap(env.step)(state, action)
        logits, value = evaluate_position(params, key, state)
        done = state.terminated | state.truncated
        output = mctx.RecurrentFnOutput(
            reward=state.rewards[jnp.arange(action.shape[0]), mover],
            discount=jnp.where(done, 0.0, -1.0),
            prior_logits=masked_logits(logits, state.legal_action_mask),
            value=jnp.where(done, 0.0, value),
        )
        return output, state

    return recurrent_fn


def run_search(
    search: str,
    params,
    key,
    state,
    root_logits,
    root_value,
    recurrent_fn,
    *,
    num_simulations: int,
    max_num_considered_actions: int,
    gumbel_scale,
    temperature,
    dirichlet_alpha,
    dirichlet_fraction,
) -> mctx.PolicyOutput:
    """One batched search from the positions `state` [B]: `root_logits` [B, num_actions] and
    `root_value` [B] from the mover's side. Illegal moves are masked in the root prior and
    excluded by `invalid_actions`, so the chosen action is always legal. The tuning arguments
    after `*` are mctx's, by keyword as mctx takes them: gumbel uses
    max_num_considered_actions and gumbel_scale, puct the temperature and the Dirichlet noise."""
    root = mctx.RootFnOutput(
        prior_logits=masked_logits(root_logits, state.legal_action_mask),
        value=root_value,
        embedding=state,
    )
    common = dict(
        params=params,
        rng_key=key,
        root=root,
        recurrent_fn=recurrent_fn,
        num_simulations=num_simulations,
        invalid_actions=~state.legal_action_mask,
    )
    if search == "gumbel":
        return mctx.gumbel_muzero_policy(
            **common,
            max_num_considered_actions=max_num_considered_actions,
            gumbel_scale=gumbel_scale,
        )
    return mctx.muzero_policy(
        **common,
        dirichlet_alpha=dirichlet_alpha,
        dirichlet_fraction=dirichlet_fraction,
        temperature=temperature,
    )


def plain_search(key, state, root_logits, root_value, evaluate_position, *, env, num_simulations):
    """The search of utils/board_eval.py's plain MCTS opponent: PUCT with the real game as its
    model, `evaluate_position(params, key, state) -> (logits, value)` valuing the positions it
    reaches, no exploration noise, the most visited move. Returns actions [B]."""
    output = run_search(
        "puct",
        None,
        key,
        state,
        root_logits,
        root_value,
        make_recurrent_fn(env, evaluate_position),
        num_simulations=num_simulations,
        max_num_considered_actions=env.num_actions,  # gumbel only
        gumbel_scale=0.0,
        temperature=0.0,
        dirichlet_alpha=0.3,
        dirichlet_fraction=0.0,
    )
    return output.action


def value_targets(reward, terminated, truncated, search_value, written, td_lambda, outcome: bool):
    """Value targets for positions in time order, from the side of the player to move.

    Inputs are [time, games], oldest first; `written` [time] marks rows that hold data (the
    newest written row is the last one). Row t is a position, the move played from it, the
    mover's reward and whether the game ended (terminated, or truncated by a move limit).

    - outcome: G_t = r_t if the game terminated after move t, else r_t - G_{t+1} (the next
      position belongs to the opponent). A truncated game has no result, so its last position
      bootstraps from its own search value. Positions of games still running at the newest
      row have no target yet (known = False); the next recomputation fills them in.
    - td-lambda: G_t = r_t - ((1 - lambda) v_{t+1} + lambda G_{t+1}) with v the search values,
      and G_{t+1} := v_{t+1} at the newest row; only the newest row of a running game waits.

    Returns (targets, known), both [time, games].
    """

    def _backward(carry, row):
        next_target, next_known, next_value, next_written = carry
        r, term, trunc, v, is_written = row
        if outcome:
            continued, continued_known = r - next_target, next_known
        else:
            bootstrap = jnp.where(next_known, next_target, next_value)
            continued = r - ((1.0 - td_lambda) * next_value + td_lambda * bootstrap)
            continued_known = jnp.broadcast_to(next_written, r.shape)
        target = jnp.where(term, r, jnp.where(trunc, v, continued))
        known = is_written & (term | trunc | continued_known)
        return (target, known, v, is_written), (target, known)

    num_games = reward.shape[1]
    zeros = jnp.zeros(num_games, jnp.float32)
    init = (zeros, jnp.zeros(num_games, bool), zeros, jnp.bool_(False))
    rows = (reward, terminated, truncated, search_value, written)
    _, (targets, known) = jax.lax.scan(_backward, init, rows, reverse=True)
    return targets, known


class Position(NamedTuple):
    """One searched position of self-play, as stored in the replay buffer. Its leaves share
    leading axes `...`: [G] for one move of every game, [T, G] for a self-play window, [rows,
    G] in the buffer, [B] in a minibatch."""

    obs: jax.Array  # [..., *obs_shape] as pgx gives it (bool or float32)
    legal: jax.Array  # [..., num_actions] bool
    policy: jax.Array  # [..., num_actions] the search's action weights: the policy target
    reward: jax.Array  # [...] the mover's reward for the move played
    terminated: jax.Array  # [...] bool: the game ended with a result after this move
    truncated: jax.Array  # [...] bool: the game was cut off by a move limit after this move
    search_value: jax.Array  # [...] the search's root value, from the mover's side


class ReplayBuffer(NamedTuple):
    """The last `rows` moves of every game: rows are time, columns are games, so each column
    holds consecutive positions of its games and value targets can be computed in place. A
    ring: `next_row` is where the next move goes, `size` how many rows hold data."""

    data: Position  # leaves [rows, G, ...]
    targets: jax.Array  # [rows, G] value targets, valid where known
    known: jax.Array  # [rows, G] bool
    next_row: jax.Array  # int32
    size: jax.Array  # int32


def buffer_init(example: Position, rows: int) -> ReplayBuffer:
    """An empty buffer for `rows` moves of games shaped like `example` (leaves [games, ...])."""
    data = jax.tree.map(lambda x: jnp.zeros((rows, *x.shape), x.dtype), example)
    num_games = example.reward.shape[0]
    return ReplayBuffer(
        data=data,
        targets=jnp.zeros((rows, num_games), jnp.float32),
        known=jnp.zeros((rows, num_games), bool),
        next_row=jnp.int32(0),
        size=jnp.int32(0),
    )


def buffer_add(buffer: ReplayBuffer, moves: Position) -> ReplayBuffer:
    """Append moves (leaves [steps, games, ...]) at the ring's head, overwriting the oldest."""
    rows = buffer.known.shape[0]
    steps = moves.reward.shape[0]
    index = (buffer.next_row + jnp.arange(steps)) % rows
    data = jax.tree.map(lambda store, new: store.at[index].set(new), buffer.data, moves)
    return buffer._replace(
        data=data,
        next_row=(buffer.next_row + steps) % rows,
        size=jnp.minimum(buffer.size + steps, rows),
    )


def buffer_update_targets(buffer: ReplayBuffer, td_lambda, outcome: bool) -> ReplayBuffer:
    """Recompute every value target in time order: games that ended since the last call get
    targets for all their stored positions, including those from earlier iterations."""
    rows = buffer.known.shape[0]
    order = (buffer.next_row - buffer.size + jnp.arange(rows)) % rows  # oldest first
    written = jnp.arange(rows) < buffer.size
    d = jax.tree.map(lambda x: x[order], buffer.data)
    targets, known = value_targets(
        d.reward, d.terminated, d.truncated, d.search_value, written, td_lambda, outcome
    )
    return buffer._replace(
        targets=buffer.targets.at[order].set(targets), known=buffer.known.at[order].set(known)
    )


def buffer_sample(buffer: ReplayBuffer, key, batch_size: int):
    """Uniform sample, with replacement, of positions that have a value target: (Position
    leaves [batch, ...], targets [batch], weights [batch]; weights are 0 only while no position
    has a target yet)."""
    # Inverse-CDF sampling over the known positions: O(buffer + batch log buffer), where a
    # categorical draw would make batch x buffer Gumbel numbers.
    cdf = jnp.cumsum(buffer.known.reshape(-1).astype(jnp.float32))
    point = jax.random.uniform(key, (batch_size,)) * cdf[-1]
    index = jnp.minimum(jnp.searchsorted(cdf, point, side="right"), cdf.shape[0] - 1)

    def take(x):  # [rows, games, ...] -> [batch, ...]
        return x.reshape(-1, *x.shape[2:])[index]

    return (
        jax.tree.map(take, buffer.data),
        take(buffer.targets),
        take(buffer.known).astype(jnp.float32),
    )


def az_loss(logits, value, legal, policy_target, value_target, weights):
    """Policy cross-entropy against the search's action weights (illegal moves excluded) and
    value mean squared error; `weights` mask samples. Returns (policy_loss, value_loss)."""
    log_probs = jax.nn.log_softmax(masked_logits(logits, legal))
    cross_entropy = -jnp.sum(jnp.where(legal, policy_target * log_probs, 0.0), axis=-1)
    count = jnp.maximum(weights.sum(), 1.0)
    policy_loss = jnp.sum(weights * cross_entropy) / count
    value_loss = jnp.sum(weights * jnp.square(value - value_target)) / count
    return policy_loss, value_loss


# ---------------------------------------------------------------------------------------------
# Stages: self-play -> targets -> learning, and evaluation (one seed on one device)
# ---------------------------------------------------------------------------------------------


class TrainState(NamedTuple):
    """Everything one seed carries from one iteration to the next, on one device."""

    params: dict  # the network's parameters, the same on every device
    batch_stats: dict  # BatchNorm running statistics ({} without BatchNorm)
    opt_state: optax.OptState  # Adam's moments, shaped like params
    hparams: HyperParams  # [] each
    buffer: ReplayBuffer  # leaves [rows, G, ...]
    games: pgx.State  # [G] the games in progress
    game_length: jax.Array  # [G] int32 moves played in each game so far
    key: jax.Array  # [2] uint32
    iteration: jax.Array  # [] int32


def variables_of(state: TrainState, batch_norm: bool) -> dict:
    """The network's variables: its parameters and, with BatchNorm, the running statistics."""
    if batch_norm:
        return {"params": state.params, "batch_stats": state.batch_stats}
    return {"params": state.params}


def new_games(env, key, num_games: int) -> pgx.State:
    """`num_games` games at their initial positions, leaves [num_games, ...]."""
    return jax.vmap(env.init)(jax.random.split(key, num_games))


def agent_search(
    variables,
    hp: HyperParams,
    key,
    games: pgx.State,
    *,
    env,
    network: ResNet,
    search: str,
    num_simulations: int,
    max_num_considered_actions: int,
    greedy: bool,
) -> mctx.PolicyOutput:
    """The agent's search from the positions `games` [B], the network valuing the root and
    every position the search reaches; greedy turns all exploration off. Returns mctx's
    PolicyOutput: action [B], action_weights [B, num_actions] and the search tree."""

    def evaluate_position(variables, key, state):
        return network.apply(variables, state.observation)

    logits, value = network.apply(variables, games.observation)
    zero = jnp.float32(0.0)
    return run_search(
        search,
        variables,
        key,
        games,
        logits,
        value,
        make_recurrent_fn(env, evaluate_position),
        num_simulations=num_simulations,
        max_num_considered_actions=max_num_considered_actions,
        gumbel_scale=zero if greedy else hp.gumbel_scale,
        temperature=zero if greedy else hp.temperature,
        dirichlet_alpha=hp.dirichlet_alpha,
        dirichlet_fraction=zero if greedy else hp.dirichlet_fraction,
    )


class SelfPlayOutput(NamedTuple):
    """One self-play window: T = rollout_steps searched moves of each of the G games."""

    games: pgx.State  # [G] the games after the window; unfinished ones carry over
    game_length: jax.Array  # [G] int32 moves played in each of them
    moves: Position  # leaves [T, G, ...] the searched positions, oldest first
    done: jax.Array  # [T, G] bool: the game ended with this move
    length: jax.Array  # [T, G] int32 moves the game had played after this move
    draw: jax.Array  # [T, G] bool: the game ended with this move, in a draw


def selfplay(
    variables, hp: HyperParams, key, games, game_length, *, env, search_fn, rollout_steps: int
) -> SelfPlayOutput:
    """1. Self-play: every one of the games [G] (game_length [G] moves into them) makes
    `rollout_steps` moves chosen by `search_fn` (`agent_search` with its settings bound) with
    the current network; finished games restart at once, unfinished ones carry over to the
    next iteration."""
    num_games = games.current_player.shape[0]

    def _selfplay_move(carry, key):
        games, game_length = carry
        search_key, reset_key = jax.random.split(key)
        output = search_fn(variables, hp, search_key, games, greedy=False)
        mover = games.current_player
        after = jax.vmap(env.step)(games, output.action)
        done = after.terminated | after.truncated
        position = Position(
            obs=games.observation,
            legal=games.legal_action_mask,
            policy=output.action_weights,
            reward=after.rewards[jnp.arange(num_games), mover],
            terminated=after.terminated,
            truncated=after.truncated & ~after.terminated,
            search_value=output.search_tree.node_values[:, mctx.Tree.ROOT_INDEX],
        )
        length = game_length + 1
        ended = (done, length, after.terminated & jnp.all(after.rewards == 0, axis=-1))
        fresh = new_games(env, reset_key, num_games)
        games = jax.tree.map(
            lambda new, old: jnp.where(done.reshape(-1, *[1] * (old.ndim - 1)), new, old),
            fresh,
            after,
        )
        return (games, jnp.where(done, 0, length)), (position, ended)

    (games, game_length), (moves, (done, length, draw)) = jax.lax.scan(
        _selfplay_move, (games, game_length), jax.random.split(key, rollout_steps)
    )
    return SelfPlayOutput(games, game_length, moves, done, length, draw)


def add_to_buffer(
    buffer: ReplayBuffer, moves: Position, td_lambda, *, outcome: bool
) -> ReplayBuffer:
    """2. Targets: the window's moves (leaves [T, G, ...]) go into the buffer, and value
    targets are recomputed over all of it, so games that ended in this window complete
    earlier positions too."""
    buffer = buffer_add(buffer, moves)
    return buffer_update_targets(buffer, td_lambda, outcome)


class LearnOutput(NamedTuple):
    """The network and optimiser after SGD, and the losses of each step."""

    params: dict
    batch_stats: dict
    opt_state: optax.OptState
    policy_loss: jax.Array  # [num_steps] ([] for one `sgd_step`)
    value_loss: jax.Array  # [num_steps] ([] for one `sgd_step`)


def sgd_step(
    params, batch_stats, opt_state, buffer, hp, key, *, learner, game, perms, batch_size: int
) -> LearnOutput:
    """One SGD step on B = batch_size positions sampled uniformly from those with a target,
    each seen through a random board symmetry (one of perms [S, num_actions]); gradients and
    BatchNorm statistics are averaged over devices."""
    sample_key, symmetry_key = jax.random.split(key)
    batch, targets, weights = buffer_sample(buffer, sample_key, batch_size)
    symmetry = jax.random.randint(symmetry_key, (batch_size,), 0, len(perms))
    obs, legal, policy = jax.vmap(functools.partial(augment_position, game, perms))(
        symmetry, batch.obs, batch.legal, batch.policy
    )

    def _loss(params):
        variables = {"params": params}
        if learner.batch_norm:
            variables["batch_stats"] = batch_stats
            (logits, value), updated = learner.apply(
                variables, obs, train=True, mutable=["batch_stats"]
            )
            new_stats = updated["batch_stats"]
        else:
            logits, value = learner.apply(variables, obs, train=True)
            new_stats = batch_stats
        policy_loss, value_loss = az_loss(logits, value, legal, policy, targets, weights)
        l2 = sum(jnp.sum(jnp.square(p)) for p in jax.tree.leaves(params))
        loss = policy_loss + value_loss + hp.weight_decay * l2
        return loss, (new_stats, policy_loss, value_loss)

    grads, (batch_stats, policy_loss, value_loss) = jax.grad(_loss, has_aux=True)(params)
    grads = device_mean(grads)
    # Every device normalises its own samples; averaging the running statistics keeps the
    # devices' networks identical.
    batch_stats = device_mean(batch_stats)
    updates, opt_state = optax.adam(hp.learning_rate).update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return LearnOutput(params, batch_stats, opt_state, policy_loss, value_loss)


def learn(
    params,
    batch_stats,
    opt_state,
    buffer: ReplayBuffer,
    hp: HyperParams,
    key,
    *,
    learner: ResNet,
    game: str,
    perms: np.ndarray,
    batch_size: int,
    num_steps: int,
) -> LearnOutput:
    """3. Learn: `num_steps` SGD steps (`sgd_step`, B = batch_size positions each) on the
    buffer as it is after this iteration's targets. Losses are [num_steps]."""

    def _sgd_step(carry, key):
        output = sgd_step(
            *carry, buffer, hp, key, learner=learner, game=game, perms=perms, batch_size=batch_size
        )
        return output[:3], output[3:]

    (params, batch_stats, opt_state), (policy_loss, value_loss) = jax.lax.scan(
        _sgd_step, (params, batch_stats, opt_state), jax.random.split(key, num_steps)
    )
    return LearnOutput(params, batch_stats, opt_state, policy_loss, value_loss)


def iteration_metrics(played: SelfPlayOutput, learned: LearnOutput, buffer) -> dict:
    """Scalar metrics of one iteration, reduced over devices; the self-play ones count the
    games that ended in this window (NaN where none did)."""
    finished = device_sum(played.done.sum())
    return {
        "policy_loss": device_mean(learned.policy_loss.mean()),
        "value_loss": device_mean(learned.value_loss.mean()),
        "selfplay_games": finished.astype(jnp.float32),
        "selfplay_game_length": device_sum(jnp.sum(played.done * played.length))
        / jnp.where(finished > 0, finished, jnp.nan),
        "selfplay_draw_rate": device_sum(jnp.sum(played.draw))
        / jnp.where(finished > 0, finished, jnp.nan),
        "positions_with_target": device_sum(buffer.known.sum()).astype(jnp.float32),
    }


def iterate(state: TrainState, _, *, selfplay_fn, learn_fn, outcome: bool, batch_norm: bool):
    """One AlphaZero iteration, a `lax.scan` body: self-play (`selfplay_fn`, `selfplay` bound)
    -> targets -> SGD (`learn_fn`, `learn` bound). Returns (state, scalar metrics)."""
    hp = state.hparams
    variables = variables_of(state, batch_norm)
    key, selfplay_key, sgd_key = jax.random.split(state.key, 3)
    played = selfplay_fn(variables, hp, selfplay_key, state.games, state.game_length)
    buffer = add_to_buffer(state.buffer, played.moves, hp.td_lambda, outcome=outcome)
    learned = learn_fn(state.params, state.batch_stats, state.opt_state, buffer, hp, sgd_key)
    state = state._replace(
        params=learned.params,
        batch_stats=learned.batch_stats,
        opt_state=learned.opt_state,
        buffer=buffer,
        games=played.games,
        game_length=played.game_length,
        key=key,
        iteration=state.iteration + 1,
    )
    return state, iteration_metrics(played, learned, buffer)


def evaluate(state: TrainState, key, *, search_fn, evaluate_agent_fn, batch_norm: bool) -> dict:
    """4. Evaluation: the agent's greedy search (`search_fn`, `agent_search` bound) plays
    `evaluate_agent_fn` (utils/board_eval.py's `evaluate_agent` bound): matches from both
    seats against each opponent. Returns its scalar metrics (and game records)."""
    variables = variables_of(state, batch_norm)

    def agent(games, key):
        return search_fn(variables, state.hparams, key, games, greedy=True).action

    return evaluate_agent_fn(agent, key)


def train_chunk(state: TrainState, num_updates: int, *, iterate_fn, evaluate_fn):
    """num_updates iterations (`iterate_fn`), then one evaluation (`evaluate_fn`); its metrics
    sit at the chunk's last iteration and are NaN at the others. Returns (state, metrics
    [num_updates] each, game records as they are)."""
    state, metrics = jax.lax.scan(iterate_fn, state, None, num_updates)
    key, eval_key = jax.random.split(state.key)
    evaluation = evaluate_fn(state._replace(key=key), eval_key)
    nan = jnp.full(num_updates, jnp.nan, jnp.float32)
    for name, value in evaluation.items():
        if name.startswith("record_"):
            metrics[name] = value
        else:
            metrics[name] = nan.at[-1].set(value.astype(jnp.float32))
    return state._replace(key=key), metrics


def init(key, hp: HyperParams, *, env, network, num_games: int, buffer_rows: int) -> TrainState:
    """A seed's state on this device: a fresh network (the same on every device), num_games
    (G) new games and an empty buffer of buffer_rows moves of each."""
    params_key, run_key = jax.random.split(key)
    # Same parameters on every device; games, search noise and sampling differ.
    run_key = jax.random.fold_in(run_key, jax.lax.axis_index(DEVICE_AXIS))
    games_key, run_key = jax.random.split(run_key)
    games = new_games(env, games_key, num_games)
    variables = network.init(params_key, games.observation, train=False)
    zeros = jnp.zeros(num_games, jnp.float32)
    never = jnp.zeros(num_games, bool)
    example = Position(
        obs=games.observation,
        legal=games.legal_action_mask,
        policy=jnp.zeros((num_games, env.num_actions), jnp.float32),
        reward=zeros,
        terminated=never,
        truncated=never,
        search_value=zeros,
    )
    return TrainState(
        params=variables["params"],
        batch_stats=variables.get("batch_stats", {}),
        opt_state=optax.adam(hp.learning_rate).init(variables["params"]),
        hparams=hp,
        buffer=buffer_init(example, buffer_rows),
        games=games,
        game_length=jnp.zeros(num_games, jnp.int32),
        key=run_key,
        iteration=jnp.int32(0),
    )


# ---------------------------------------------------------------------------------------------
# Wiring
# ---------------------------------------------------------------------------------------------


def validate(config: Config, runtime: Runtime) -> None:
    """ConfigError for a game this AlphaZero cannot play or settings it cannot run with on
    the runtime's devices; every check happens here, before anything is built."""
    num_devices = runtime.num_devices
    resolve_game(config.env)
    require_positive(
        config,
        "num_iterations",
        "num_games",
        "rollout_steps",
        "buffer_size",
        "updates_per_iteration",
        "minibatch_size",
        "num_blocks",
        "num_channels",
        "num_simulations",
        "max_num_considered_actions",
        "eval_every",
        "baseline_sims",
    )
    require_positive(config, "eval_games", minimum=0)
    require_in(config, "learning_rate", 0.0, 1.0, above_low=True)
    require_in(config, "dirichlet_alpha", 0.0, above_low=True)
    for name in ("td_lambda", "dirichlet_fraction"):
        require_in(config, name, 0.0, 1.0)
    for name in ("weight_decay", "gumbel_scale", "temperature"):
        require_in(config, name, 0.0)
    if config.updates_per_chunk not in (0, config.eval_every):
        raise ConfigError(
            f"--updates-per-chunk {config.updates_per_chunk}: AlphaZero's chunks are "
            f"--eval-every ({config.eval_every}) iterations long, each ending in an evaluation; "
            "set --eval-every instead"
        )
    for name in ("num_games", "minibatch_size"):
        if getattr(config, name) % num_devices:
            raise ConfigError(
                f"--{name.replace('_', '-')} {getattr(config, name)} is not divisible by the "
                f"{num_devices} devices"
            )
    if config.eval_games % (2 * num_devices):
        raise ConfigError(
            f"--eval-games {config.eval_games} must split evenly into both seats on "
            f"{num_devices} device(s): use a multiple of {2 * num_devices}"
        )
    buffer_rows = config.buffer_size // config.num_games  # moves kept of each game slot
    if buffer_rows < config.rollout_steps:
        raise ConfigError(
            f"--buffer-size {config.buffer_size} keeps only {buffer_rows} moves of each of the "
            f"{config.num_games} games, fewer than one iteration's --rollout-steps "
            f"{config.rollout_steps}"
        )


def make_train(config: Config, runtime: Runtime | None = None) -> Trainer:
    """The stages bound to this run's static settings (game, network, sizes per device), and
    the Trainer the driver runs them with; without a runtime, for one run on one device."""
    runtime = runtime or Runtime()
    num_devices = runtime.num_devices
    game = resolve_game(config.env)
    env = pgx.make(game)
    num_actions = env.num_actions
    perms = (
        action_permutations(game, num_actions) if config.augment else np.arange(num_actions)[None]
    )
    oracle_table = jnp.asarray(solve_tic_tac_toe()) if game == "tic_tac_toe" else None
    network, learner = make_networks(config, env, one_run=runtime.num_runs == 1)

    search_fn = functools.partial(
        agent_search,
        env=env,
        network=network,
        search=config.search,
        num_simulations=config.num_simulations,
        max_num_considered_actions=config.max_num_considered_actions,
    )
    iterate_fn = functools.partial(
        iterate,
        selfplay_fn=functools.partial(
            selfplay, env=env, search_fn=search_fn, rollout_steps=config.rollout_steps
        ),
        learn_fn=functools.partial(
            learn,
            learner=learner,
            game=game,
            perms=perms,
            batch_size=config.minibatch_size // num_devices,
            num_steps=config.updates_per_iteration,
        ),
        outcome=config.value_target == "outcome",
        batch_norm=config.batch_norm,
    )
    mcts_search = functools.partial(plain_search, env=env, num_simulations=config.baseline_sims)
    players = opponents(env, mcts_search, oracle_table)
    evaluate_fn = functools.partial(
        evaluate,
        search_fn=search_fn,
        evaluate_agent_fn=functools.partial(
            evaluate_agent,
            env=env,
            players=players,
            num_games=config.eval_games // num_devices,
            oracle_table=oracle_table,
            capture_video=config.record_games,
        ),
        batch_norm=config.batch_norm,
    )
    if not config.eval_games:  # --eval-games 0: chunks end without an evaluation

        def evaluate_fn(state, key):
            return {}

    def evaluate_again(state, key):
        """The in-loop evaluation of a finished run's state alone (--resume with --eval-games);
        the driver's key is the same on every device, so each device folds in its index."""
        return evaluate_fn(state, jax.random.fold_in(key, jax.lax.axis_index(DEVICE_AXIS)))

    return Trainer(
        algo="az",
        env_id=game,
        num_updates=config.num_iterations,
        steps_per_update=config.num_games * config.rollout_steps,
        hyperparams=hyperparams_of(HyperParams, config),
        init=functools.partial(
            init,
            env=env,
            network=network,
            num_games=config.num_games // num_devices,
            buffer_rows=config.buffer_size // config.num_games,  # moves kept of each game slot
        ),
        train_chunk=functools.partial(train_chunk, iterate_fn=iterate_fn, evaluate_fn=evaluate_fn),
        evaluate=None,
        runtime=runtime,
        # the score against plain MCTS; without an evaluation, self-play's value loss
        headline_metric="eval_mcts_score" if config.eval_games else "value_loss",
        step_unit="moves",
        updates_per_chunk=config.eval_every,
        write_records=functools.partial(write_game_records, env=env, opponent_names=tuple(players)),
        # JAX's rolled CPU form: self-play runs slower unrolled (docs/benchmarks.md)
        unrolled_threefry=False,
        guarded_metrics=("policy_loss", "value_loss"),
        guarded_state=lambda state: (state.params, state.batch_stats, state.opt_state),
        chunk_evaluation=evaluate_again if config.eval_games else None,
    )


def main() -> None:
    """The command line: parse the flags, then train; or, with --play or --arena, play a
    trained run against you or against another run (utils/board_play.py)."""
    with exit_on_config_error():
        if board_play.requested(sys.argv[1:]):
            board_play.main(sys.modules[__name__])
            return
        config = parse_config(
            Config, PRESETS, preset_key=resolve_game, shell_defaults={"cpu_devices": -1}
        )
        run_training(config, make_train, validate)


if __name__ == "__main__":
    main()
