"""AlphaZero for pgx's two-player board games and for 2048: self-play with MCTS (mctx), value
and policy targets, an on-device replay buffer, SGD and evaluation, all in one compiled JAX
program.

    python purejaxrl_az.py --env tic_tac_toe          # near-perfect play by iteration 30 of 100
    python purejaxrl_az.py --env connect_four --cpu-devices 2
    python purejaxrl_az.py --env othello --search puct --temperature 1.0
    python purejaxrl_az.py --env 2048                 # single player, search through tile spawns

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

2048 is single-player and stochastic: a move slides the tiles (the merge reward), then a tile
spawns at random. Its search is Stochastic MuZero's (mctx's `stochastic_muzero_policy`) with
the true rules as the model, split where the chance happens (utils/game2048.py): decision nodes
choose a move, chance nodes weigh the 32 spawns by their real probabilities. Discount --gamma
between moves, no sign flip; its network (`MLPNet`) values states and afterstates on MuZero's
h(x) scale with categorical heads, since scores grow into the thousands.
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

from utils import board_play, game2048
from utils.board_eval import (
    OPPONENTS,
    evaluate_agent,
    opponents,
    solve_tic_tac_toe,
    write_game_records,
)
from utils.cli import RunConfig, exit_on_config_error, parse_config, require_in, require_positive
from utils.devices import DEVICE_AXIS, available_cores, device_mean, device_sum
from utils.driver import run_training
from utils.errors import ConfigError
from utils.layers import Conv3x3
from utils.trainer import Runtime, Trainer, hyperparams_of, scan_updates


@dataclasses.dataclass
class Config(RunConfig):
    """AlphaZero (Gumbel MuZero search by default) on pgx two-player board games, and with
    Stochastic MuZero's search on 2048, compiled end to end with JAX. A trained run plays you
    with --play RUN_DIR (2048: replays its game), another run with --arena RUN_A RUN_B (their
    flags: --play X --help)."""

    env: str = "tic_tac_toe"
    """pgx game id: tic_tac_toe, connect_four, othello, hex, go_9x9, go_19x19, animal_shogi,
    gardner_chess, chess, shogi, 2048. Each game has its own preset defaults"""
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
    """residual blocks of the ResNet (2048: of the MLP)"""
    num_channels: int = 32
    """channels of every convolution (2048: width of the MLP)"""
    batch_norm: bool = True
    """BatchNorm in the ResNet (running statistics are used for search, batch ones in SGD);
    2048's MLP uses LayerNorm instead"""
    search: Literal["gumbel", "puct"] = "gumbel"
    """gumbel: Gumbel MuZero policy (sequential halving, improved-policy targets); puct:
    AlphaZero's PUCT (Dirichlet noise at the root, visit-count targets), the only one with
    chance nodes (2048)"""
    num_simulations: int = 32
    """MCTS simulations per move in self-play"""
    eval_simulations: int = 0
    """MCTS simulations per move of the agent in evaluation (0: --num-simulations)"""
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
    gamma: float = 1.0
    """single-player games (2048): discount of later merge rewards, in search and value targets
    (two-player games alternate sides instead: 1 there)"""
    augment: bool = True
    """train on a random board symmetry of each position (connect_four: mirror; tic_tac_toe,
    othello, go, 2048: the 8 rotations and reflections; hex: 180-degree rotation; none for
    chess-like games)"""
    eval_every: int = 10
    """iterations between evaluations; a compiled chunk ends with one, so logging and
    checkpoints happen at the same points"""
    eval_games: int = 64
    """evaluation games per opponent, half with the agent moving first (0: no evaluation)"""
    baseline_sims: int = 64
    """simulations of the plain MCTS opponent (uniform priors, random-rollout values)"""
    eval_opponents: tuple[str, ...] = ("random", "mcts")
    """board games: the evaluation's opponents, each played from both seats: random, mcts
    (plain MCTS of --baseline-sims simulations), oracle (tic_tac_toe's perfect player)"""
    expectimax_depth: int = 2
    """2048: moves the plain expectimax player looks ahead (its evaluation baseline)"""
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
# player steers into are never trained on. It takes 16 gradient steps per iteration at twice
# the learning rate: SGD is a small part of an iteration here, and learning more from each
# iteration's games reaches perfect play in fewer iterations. The runs behind this:
# docs/alphazero.md, "Results". Its evaluation plays the perfect player instead of plain MCTS,
# which that makes redundant and which was a third of the chunk's compilation
# (docs/benchmarks.md). connect_four learns at that rate too, with 16 gradient steps; its
# self-play searches with 16 simulations, which learned about as much per iteration as 32 for
# half the network calls, while the evaluated agent keeps 32: it beat plain MCTS sooner
# (docs/benchmarks.md, "AlphaZero connect_four").
PRESETS = {
    "tic_tac_toe": dict(
        num_games=128,
        buffer_size=65_536,
        gumbel_scale=2.0,
        updates_per_iteration=16,
        learning_rate=2e-3,
        eval_opponents=("random", "oracle"),
    ),
    "connect_four": dict(
        num_iterations=300,
        num_games=128,
        rollout_steps=32,
        buffer_size=32_768,
        num_simulations=16,
        eval_simulations=32,
        updates_per_iteration=16,
        learning_rate=2e-3,
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
    # Single player: PUCT over chance nodes, lambda-returns of the merge rewards (a game's
    # outcome is thousands of points of noise), an MLP, and few simulations, since every one
    # evaluates the network twice (afterstate and state). Without the board's symmetries,
    # which learned slower in the runs of docs/alphazero.md, "2048".
    "2048": dict(
        augment=False,
        search="puct",
        num_simulations=16,
        value_target="td-lambda",
        td_lambda=0.9,
        gamma=0.999,
        batch_norm=False,
        num_blocks=2,
        num_channels=128,
        num_games=64,
        rollout_steps=32,
        buffer_size=16_384,
        minibatch_size=256,
        num_iterations=200,
        eval_every=20,
        eval_games=32,
    ),
}


class HyperParams(NamedTuple):
    """Hyperparameters that change no array shape. They travel in the training state as
    arrays, so that --sweep can vary them inside one program; the driver makes those that no
    sweep varies constants of the program (utils/trainer.py)."""

    learning_rate: jax.Array
    weight_decay: jax.Array
    gumbel_scale: jax.Array
    temperature: jax.Array
    dirichlet_alpha: jax.Array
    dirichlet_fraction: jax.Array
    td_lambda: jax.Array
    gamma: jax.Array


# ---------------------------------------------------------------------------------------------
# Games and their board symmetries
# ---------------------------------------------------------------------------------------------

# Two-player, zero-sum, perfect-information, deterministic: the games where the pgx simulator
# can be the search's model and players alternate; and 2048, single player, whose model is its
# rules split at the tile spawn (utils/game2048.py).
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
    "2048",
)

# The other pgx games, and why this AlphaZero does not play them.
REFUSED_GAMES = {
    "backgammon": "its dice come before each move, and the search's chance nodes only follow "
    "a single player's moves here",
    **dict.fromkeys(
        ("kuhn_poker", "leduc_holdem", "sparrow_mahjong"),
        "a hidden-information game, where a search over the true state would see the "
        "opponent's cards",
    ),
}


def resolve_game(name: str) -> str:
    """The pgx id of a supported game (any case, '-' for '_'), or a ConfigError listing them."""
    game = name.lower().replace("-", "_")
    if game in SUPPORTED_GAMES:
        return game
    if game in REFUSED_GAMES:
        reason = f" (a pgx game, but {REFUSED_GAMES[game]})"
    elif game.startswith("minatar"):
        reason = (
            " (a pgx game, but a video game: train it with purejaxrl_ppo.py or purejaxrl_dqn.py)"
        )
    else:
        reason = ""
    raise ConfigError(f"unknown game {name!r}{reason}; valid games: {', '.join(SUPPORTED_GAMES)}")


def _dihedral(x, k: int):
    """The k-th of the 8 rotations/reflections of the board in axes (0, 1) of x: k % 4
    quarter turns as np.rot90 makes them, then for k >= 4 a transpose. Written with methods
    that NumPy and JAX arrays share, so that action_permutations runs on the host instead of
    compiling a small program per operation."""
    for _ in range(k % 4):
        x = x.swapaxes(0, 1)[::-1]
    return x.swapaxes(0, 1) if k >= 4 else x


# Per game: the board transforms (functions on arrays whose first two axes are the board) and
# the shape of the grid that board actions index in row-major order; actions past the grid
# (pass, swap) are fixed by every symmetry. 2048's actions are directions instead.
SYMMETRIES = {
    "tic_tac_toe": ([functools.partial(_dihedral, k=k) for k in range(8)], (3, 3)),
    "othello": ([functools.partial(_dihedral, k=k) for k in range(8)], (8, 8)),
    "go_9x9": ([functools.partial(_dihedral, k=k) for k in range(8)], (9, 9)),
    "go_19x19": ([functools.partial(_dihedral, k=k) for k in range(8)], (19, 19)),
    # Gravity: only the left-right mirror. Actions are columns, a 1-row grid.
    "connect_four": ([lambda x: x, lambda x: x[:, ::-1]], (1, 7)),
    # Each player's two edges stay theirs only under the half turn.
    "hex": ([lambda x: x, functools.partial(_dihedral, k=2)], (11, 11)),
    "2048": ([functools.partial(_dihedral, k=k) for k in range(8)], "directions"),
}


def direction_permutation(transform) -> np.ndarray:
    """[4] for 2048: new move = result[old move] under a board transform. Move a slides the
    tiles toward the low values of np.rot90(distance from the left edge, -a) (pgx turns the
    board a quarter turns, then slides left), so the transformed field of move a is the field
    of the move it becomes."""
    fields = [np.rot90(np.tile(np.arange(4), (4, 1)), -a) for a in range(4)]
    moved = [transform(field) for field in fields]
    return np.array([next(b for b in range(4) if (m == fields[b]).all()) for m in moved])


def action_permutations(game: str, num_actions: int) -> np.ndarray:
    """[num_symmetries, num_actions] int: under symmetry k, new_policy = policy[perm[k]]. The
    transform moves board cells, so the grid of cell indices, transformed, says for every new
    cell which old cell it came from."""
    transforms, grid_shape = SYMMETRIES.get(game, ([lambda x: x], None))
    if grid_shape is None:
        return np.arange(num_actions)[None]
    if grid_shape == "directions":
        return np.stack([np.argsort(direction_permutation(t)) for t in transforms])
    num_cells = grid_shape[0] * grid_shape[1]
    grid = np.arange(num_cells).reshape(grid_shape)
    extra = np.arange(num_cells, num_actions)
    return np.stack([np.concatenate([t(grid).ravel(), extra]) for t in transforms])


def augment_position(game: str, perms: np.ndarray, k, obs, legal, policy, action):
    """Symmetry k (traced) applied consistently to one position's observation, legal mask,
    policy target and the move played."""
    transforms, _ = SYMMETRIES.get(game, ([lambda x: x], None))
    obs = jax.lax.switch(k, transforms, obs)
    perm = jnp.asarray(perms)[k]
    return obs, legal[perm], policy[perm], jnp.argmax(perm == action).astype(jnp.int32)


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


# 2048's values are sums of merge rewards, thousands of points: the network predicts them on
# MuZero's scale h(x) = sign(x) (sqrt(|x| + 1) - 1) + eps x, as a distribution over the
# integers 0..VALUE_BINS - 1 of that scale (values up to about 45,000), trained with
# cross-entropy against the "two-hot" encoding of the target (Schrittwieser et al., 2020).
VALUE_BINS = 256
VALUE_EPS = 1e-3


def value_transform(x):
    """MuZero's h(x): a square-root squash, invertible, near-linear again past 1e6."""
    return jnp.sign(x) * (jnp.sqrt(jnp.abs(x) + 1.0) - 1.0) + VALUE_EPS * x


def inverse_value_transform(y):
    """h^-1(y), in closed form."""
    root = (jnp.sqrt(1.0 + 4.0 * VALUE_EPS * (jnp.abs(y) + 1.0 + VALUE_EPS)) - 1.0) / (
        2.0 * VALUE_EPS
    )
    return jnp.sign(y) * (jnp.square(root) - 1.0)


def two_hot(values):
    """[...] values -> [..., VALUE_BINS] the distribution on bins of h(value) with the same mean:
    weight split between the two neighbouring bins, clipped to the support."""
    y = jnp.clip(value_transform(values), 0.0, VALUE_BINS - 1.0)
    low = jnp.floor(y)
    upper_weight = y - low
    bins = jnp.arange(VALUE_BINS, dtype=jnp.float32)
    return jnp.where(bins == low[..., None], 1.0 - upper_weight[..., None], 0.0) + jnp.where(
        bins == low[..., None] + 1.0, upper_weight[..., None], 0.0
    )


def value_at_zero(key, shape, dtype=jnp.float32):
    """Value logits [VALUE_BINS] whose value is about 0 (bin 0 at e^20 times any other): the
    value heads' bias at initialisation, with zero weights. An untrained network then values
    every position alike, rather than with the noise of random value heads whose values span
    thousands, and its search weighs the merge rewards it can see through the rules."""
    del key
    return jnp.where(jnp.arange(shape[-1]) == 0, 0.0, -20.0).astype(dtype)


def value_of(value_logits):
    """[..., VALUE_BINS] logits -> [...] the value: h^-1 of the distribution's mean bin."""
    bins = jnp.arange(VALUE_BINS, dtype=jnp.float32)
    return inverse_value_transform(jnp.sum(jax.nn.softmax(value_logits) * bins, axis=-1))


class MLPNet(nn.Module):
    """2048's network: the one-hot board (4, 4, 31) flattened, a Dense stem, pre-activation
    residual blocks of (LayerNorm, relu, Dense) x 2, then three heads: policy logits [A], and
    value logits [VALUE_BINS] of the board as a state and as an afterstate (the board a move
    leaves before its tile spawns). A 4x4 board is too small for convolutions to pay."""

    num_actions: int
    num_blocks: int
    num_channels: int
    batch_norm: bool = False  # LayerNorm: no running statistics to carry

    @nn.compact
    def __call__(self, obs, train: bool = False):
        x = obs.reshape(*obs.shape[:-3], -1).astype(jnp.float32)
        x = nn.Dense(self.num_channels)(x)
        for _ in range(self.num_blocks):
            y = nn.Dense(self.num_channels)(nn.relu(nn.LayerNorm()(x)))
            x = x + nn.Dense(self.num_channels)(nn.relu(nn.LayerNorm()(y)))
        x = nn.relu(nn.LayerNorm()(x))

        def value_head(x):
            return nn.Dense(VALUE_BINS, kernel_init=nn.initializers.zeros, bias_init=value_at_zero)(
                x
            )

        return nn.Dense(self.num_actions)(x), value_head(x), value_head(x)


def game_shapes(env) -> tuple[int, tuple[int, ...]]:
    """(number of actions, observation shape) of a pgx game, from its initial state traced
    abstractly: pgx's own env.num_actions and env.observation_shape run env.init, which
    outside jit compiles a small program per operation."""
    state = jax.eval_shape(lambda: env.init(jax.random.PRNGKey(0)))
    return state.legal_action_mask.shape[-1], state.observation.shape


def make_networks(
    config: Config, env, *, one_run: bool, on_cpu: bool, one_core_each: bool = False
) -> tuple[nn.Module, nn.Module]:
    """The ResNet for search and the same one for SGD (`learner`): one set of parameters,
    several ways to compute its convolutions (utils/layers.py). On boards of at most 3x3
    (tic_tac_toe) one dense matmul over the whole board does the convolution's own arithmetic:
    fastest for SGD, and for search while XLA can spread that matmul over several cores of a
    device. Otherwise, on larger boards and on a CPU split into a device per core
    (`one_core_each`), search runs XLA's convolution with one run, the fastest forward pass,
    and the matmul form with vmapped seeds or sweep configurations (`one_run` False), where
    XLA's convolution with batched parameters is slow. SGD on larger boards runs XLA's
    convolution with one run on a CPU (`on_cpu`), the matmul form otherwise: on a TPU the
    two train at the same speed and the matmul form compiles sooner (docs/benchmarks.md).
    2048 gets its MLP."""
    num_actions, observation_shape = game_shapes(env)
    if env.id == "2048":
        network = MLPNet(num_actions, config.num_blocks, config.num_channels)
        return network, network
    small_board = max(observation_shape[:2]) <= 3
    search_method = "dense" if small_board and not one_core_each else "xla" if one_run else "matmul"
    network = ResNet(
        num_actions,
        config.num_blocks,
        config.num_channels,
        config.batch_norm,
        conv_method=search_method,
    )
    learner_method = "dense" if small_board else "xla" if one_run and on_cpu else "matmul"
    return network, network.clone(conv_method=learner_method)


# ---------------------------------------------------------------------------------------------
# Pure pieces: priors, search, value targets, replay buffer, loss
# ---------------------------------------------------------------------------------------------

# The evaluation's key is fold_in(state.key, this). fold_in(key, i) is split(key, n)[i] for
# i < n, so a number far above any split's size keeps it apart from training's keys.
EVALUATION_KEY_DATA = 2**31 - 1
EVAL_MAX_MOVES = 20_000  # 2048: evaluation games end here if the game has not (about a 16k tile)

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


class Board(NamedTuple):
    """Decision nodes of 2048's search: positions where the player chooses a move."""

    board: jax.Array  # [B, 16] int32 tile exponents (utils/game2048.py)
    done: jax.Array  # [B] bool: no legal move is left, or a dead move led here


class Afterstate(NamedTuple):
    """Chance nodes of 2048's search: a move made, its tile not spawned yet."""

    board: jax.Array  # [B, 16] int32
    reward: jax.Array  # [B] float32 the move's merge reward
    dead: jax.Array  # [B] bool: the move moved nothing (illegal), or the game was already over


def make_chance_model(evaluate_board, gamma):
    """mctx's decision and chance functions for 2048 with its true rules: a move slides the
    tiles (`game2048.slide`), a chance outcome spawns a tile (`game2048.spawn`) with its real
    probability. `evaluate_board(params, boards [B, 16]) -> (logits [B, 4], state value [B],
    afterstate value [B])`. mctx gives a move no reward, so the merge reward comes with the
    spawn that follows, and an afterstate's value is reward + gamma * the network's afterstate
    value. A dead move is worth 0 and ends the line (discount 0), as does a board without a
    legal move."""

    def decision_recurrent_fn(params, key, action, node: Board):
        after, reward, moved = jax.vmap(game2048.slide)(node.board, action)
        dead = node.done | ~moved
        _, _, after_value = evaluate_board(params, after)
        probabilities = jax.vmap(game2048.spawn_probabilities)(after)
        output = mctx.DecisionRecurrentFnOutput(
            chance_logits=jnp.where(probabilities > 0, jnp.log(probabilities), ILLEGAL_LOGIT),
            afterstate_value=jnp.where(dead, 0.0, reward + gamma * after_value),
        )
        return output, Afterstate(after, reward, dead)

    def chance_recurrent_fn(params, key, outcome, node: Afterstate):
        board = jax.vmap(game2048.spawn)(node.board, outcome)
        legal = jax.vmap(game2048.legal_moves)(board)
        done = node.dead | ~jnp.any(legal, axis=-1)
        logits, value, _ = evaluate_board(params, board)
        output = mctx.ChanceRecurrentFnOutput(
            action_logits=masked_logits(logits, legal),
            value=jnp.where(done, 0.0, value),
            reward=jnp.where(node.dead, 0.0, node.reward),
            discount=jnp.where(done, 0.0, gamma),
        )
        return output, Board(board, done)

    return decision_recurrent_fn, chance_recurrent_fn


def chance_search(
    params,
    key,
    games,
    root_logits,
    root_value,
    evaluate_board,
    *,
    gamma,
    num_simulations: int,
    temperature,
    dirichlet_alpha,
    dirichlet_fraction,
) -> mctx.PolicyOutput:
    """One batched Stochastic MuZero search (PUCT at decision nodes, chance outcomes visited in
    proportion to their probability) from the 2048 positions `games` [B], `root_logits` [B, 4]
    and `root_value` [B]; illegal moves are masked at the root as in `run_search`."""
    decision_fn, chance_fn = make_chance_model(evaluate_board, gamma)
    root = mctx.RootFnOutput(
        prior_logits=masked_logits(root_logits, games.legal_action_mask),
        value=root_value,
        embedding=Board(jax.vmap(game2048.board_of)(games.observation), games.terminated),
    )
    return mctx.stochastic_muzero_policy(
        params,
        key,
        root,
        decision_fn,
        chance_fn,
        num_simulations,
        invalid_actions=~games.legal_action_mask,
        temperature=temperature,
        dirichlet_alpha=dirichlet_alpha,
        dirichlet_fraction=dirichlet_fraction,
    )


def value_targets(
    reward, terminated, truncated, search_value, written, td_lambda, discount, outcome: bool
):
    """Value targets for positions in time order, from the side of the player to move.

    Inputs are [time, games], oldest first; `written` [time] marks rows that hold data (the
    newest written row is the last one). Row t is a position, the move played from it, the
    mover's reward and whether the game ended (terminated, or truncated by a move limit).
    `discount` d links a position to the next: -1 in two-player games (the next position
    belongs to the opponent), gamma in a single-player one.

    - outcome: G_t = r_t if the game terminated after move t, else r_t + d G_{t+1}. A
      truncated game has no result, so its last position bootstraps from its own search
      value. Positions of games still running at the newest row have no target yet (known =
      False); the next recomputation fills them in.
    - td-lambda: G_t = r_t + d ((1 - lambda) v_{t+1} + lambda G_{t+1}) with v the search
      values, and G_{t+1} := v_{t+1} at the newest row; only the newest row of a running game
      waits.

    Returns (targets, known), both [time, games].
    """

    def _backward(carry, row):
        next_target, next_known, next_value, next_written = carry
        r, term, trunc, v, is_written = row
        if outcome:
            continued, continued_known = r + discount * next_target, next_known
        else:
            bootstrap = jnp.where(next_known, next_target, next_value)
            continued = r + discount * ((1.0 - td_lambda) * next_value + td_lambda * bootstrap)
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
    action: jax.Array  # [...] int32 the move played
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


def buffer_update_targets(buffer: ReplayBuffer, td_lambda, discount, outcome: bool) -> ReplayBuffer:
    """Recompute every value target in time order: games that ended since the last call get
    targets for all their stored positions, including those from earlier iterations."""
    rows = buffer.known.shape[0]
    order = (buffer.next_row - buffer.size + jnp.arange(rows)) % rows  # oldest first
    written = jnp.arange(rows) < buffer.size
    d = jax.tree.map(lambda x: x[order], buffer.data)
    targets, known = value_targets(
        d.reward, d.terminated, d.truncated, d.search_value, written, td_lambda, discount, outcome
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


def weighted_mean(losses, weights):
    """The mean of per-sample losses [B] over the samples that `weights` [B] keep (0 while no
    sample is kept)."""
    return jnp.sum(weights * losses) / jnp.maximum(weights.sum(), 1.0)


def policy_loss_of(logits, legal, policy_target, weights):
    """Policy cross-entropy against the search's action weights (illegal moves excluded),
    averaged with `weights` [B]."""
    log_probs = jax.nn.log_softmax(masked_logits(logits, legal))
    cross_entropy = -jnp.sum(jnp.where(legal, policy_target * log_probs, 0.0), axis=-1)
    return weighted_mean(cross_entropy, weights)


def az_loss(logits, value, legal, policy_target, value_target, weights):
    """`policy_loss_of` and the value's mean squared error; `weights` mask samples. Returns
    (policy_loss, value_loss)."""
    value_loss = weighted_mean(jnp.square(value - value_target), weights)
    return policy_loss_of(logits, legal, policy_target, weights), value_loss


def categorical_value_loss(value_logits, value_target, weights):
    """Cross-entropy of value logits [B, VALUE_BINS] against the two-hot encoding of the
    targets [B], averaged with `weights` [B]."""
    cross_entropy = -jnp.sum(two_hot(value_target) * jax.nn.log_softmax(value_logits), axis=-1)
    return weighted_mean(cross_entropy, weights)


def board_loss(apply, batch: Position, obs, legal, policy, action, targets, weights, gamma):
    """The board games' loss (`az_loss`) of the learner (`apply(obs) -> (outputs, BatchNorm
    statistics)`) on the augmented positions (obs, legal, policy, action). Returns
    (policy_loss, value_loss, statistics)."""
    (logits, value), new_stats = apply(obs)
    return (*az_loss(logits, value, legal, policy, targets, weights), new_stats)


def chance_loss(apply, batch: Position, obs, legal, policy, action, targets, weights, gamma):
    """2048's loss: the policy cross-entropy (`policy_loss_of`), plus categorical value losses of the
    position and of its afterstate (the board after the move played, before its spawn). The
    afterstate's target follows from the position's: G_t = r_t + gamma * (what follows the
    afterstate), 0 once the game has ended. The reported value loss is their sum."""
    after, _, _ = jax.vmap(game2048.slide)(jax.vmap(game2048.board_of)(obs), action)
    both = jnp.concatenate([obs, jax.vmap(game2048.observation)(after).astype(obs.dtype)])
    (logits, value_logits, after_logits), new_stats = apply(both)
    size = obs.shape[0]
    after_targets = jnp.where(batch.terminated, 0.0, (targets - batch.reward) / gamma)
    policy_loss = policy_loss_of(logits[:size], legal, policy, weights)
    value_loss = categorical_value_loss(value_logits[:size], targets, weights)
    after_loss = categorical_value_loss(after_logits[size:], after_targets, weights)
    return policy_loss, value_loss + after_loss, new_stats


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
    game_score: jax.Array  # [G] float32 the rewards each game's movers have received so far
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
    every position the search reaches; greedy turns all exploration off. 2048 searches with
    chance nodes (`chance_search`, PUCT whatever `search` says). Returns mctx's PolicyOutput:
    action [B], action_weights [B, num_actions] and the search tree."""
    zero = jnp.float32(0.0)
    if env.id == "2048":

        def evaluate_board(variables, boards):
            logits, value_logits, after_logits = network.apply(
                variables, jax.vmap(game2048.observation)(boards)
            )
            return logits, value_of(value_logits), value_of(after_logits)

        logits, value_logits, _ = network.apply(variables, games.observation)
        return chance_search(
            variables,
            key,
            games,
            logits,
            value_of(value_logits),
            evaluate_board,
            gamma=hp.gamma,
            num_simulations=num_simulations,
            temperature=zero if greedy else hp.temperature,
            dirichlet_alpha=hp.dirichlet_alpha,
            dirichlet_fraction=zero if greedy else hp.dirichlet_fraction,
        )

    def evaluate_position(variables, key, state):
        return network.apply(variables, state.observation)

    logits, value = network.apply(variables, games.observation)
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
    game_score: jax.Array  # [G] float32 the rewards their movers have received so far
    moves: Position  # leaves [T, G, ...] the searched positions, oldest first
    done: jax.Array  # [T, G] bool: the game ended with this move
    length: jax.Array  # [T, G] int32 moves the game had played after this move
    score: jax.Array  # [T, G] float32 the game's summed rewards after this move (2048: score)
    draw: jax.Array  # [T, G] bool: the game ended with this move, in a draw


def step_games(env, games, actions, key):
    """Every game [B] one move on; `key` is None for a deterministic game, else the key of the
    move's chance (2048's spawn)."""
    if key is None:
        return jax.vmap(env.step)(games, actions)
    return jax.vmap(env.step)(games, actions, jax.random.split(key, actions.shape[0]))


def selfplay(
    variables,
    hp: HyperParams,
    key,
    games,
    game_length,
    game_score,
    *,
    env,
    search_fn,
    rollout_steps: int,
    stochastic: bool,
) -> SelfPlayOutput:
    """1. Self-play: every one of the games [G] (game_length [G] moves into them, game_score
    [G] rewards received) makes `rollout_steps` moves chosen by `search_fn` (`agent_search`
    with its settings bound) with the current network; finished games restart at once,
    unfinished ones carry over to the next iteration. A stochastic game's moves draw their
    chance from a key of their own."""
    num_games = games.current_player.shape[0]

    def _selfplay_move(carry, key):
        games, game_length, game_score = carry
        if stochastic:
            search_key, reset_key, chance_key = jax.random.split(key, 3)
        else:
            (search_key, reset_key), chance_key = jax.random.split(key), None
        output = search_fn(variables, hp, search_key, games, greedy=False)
        mover = games.current_player
        after = step_games(env, games, output.action, chance_key)
        done = after.terminated | after.truncated
        reward = after.rewards[jnp.arange(num_games), mover]
        position = Position(
            obs=games.observation,
            legal=games.legal_action_mask,
            action=output.action,
            policy=output.action_weights,
            reward=reward,
            terminated=after.terminated,
            truncated=after.truncated & ~after.terminated,
            search_value=output.search_tree.node_values[:, mctx.Tree.ROOT_INDEX],
        )
        length, score = game_length + 1, game_score + reward
        ended = (done, length, score, after.terminated & jnp.all(after.rewards == 0, axis=-1))
        fresh = new_games(env, reset_key, num_games)
        games = jax.tree.map(
            lambda new, old: jnp.where(done.reshape(-1, *[1] * (old.ndim - 1)), new, old),
            fresh,
            after,
        )
        carry = (games, jnp.where(done, 0, length), jnp.where(done, 0.0, score))
        return carry, (position, ended)

    (games, game_length, game_score), (moves, (done, length, score, draw)) = jax.lax.scan(
        _selfplay_move, (games, game_length, game_score), jax.random.split(key, rollout_steps)
    )
    return SelfPlayOutput(games, game_length, game_score, moves, done, length, score, draw)


def add_to_buffer(
    buffer: ReplayBuffer, moves: Position, td_lambda, discount, *, outcome: bool
) -> ReplayBuffer:
    """2. Targets: the window's moves (leaves [T, G, ...]) go into the buffer, and value
    targets are recomputed over all of it (`discount`: see `value_targets`), so games that
    ended in this window complete earlier positions too."""
    buffer = buffer_add(buffer, moves)
    return buffer_update_targets(buffer, td_lambda, discount, outcome)


class LearnOutput(NamedTuple):
    """The network and optimiser after SGD, and the losses of each step."""

    params: dict
    batch_stats: dict
    opt_state: optax.OptState
    policy_loss: jax.Array  # [num_steps] ([] for one `sgd_step`)
    value_loss: jax.Array  # [num_steps] ([] for one `sgd_step`)


def sgd_step(
    params,
    batch_stats,
    opt_state,
    buffer,
    hp,
    key,
    *,
    learner,
    loss_fn,
    game,
    perms,
    batch_size: int,
) -> LearnOutput:
    """One SGD step of `loss_fn` (`board_loss` or `chance_loss`) on B = batch_size positions
    sampled uniformly from those with a target, each seen through a random board symmetry (one
    of perms [S, num_actions]); gradients and BatchNorm statistics are averaged over devices."""
    sample_key, symmetry_key = jax.random.split(key)
    batch, targets, weights = buffer_sample(buffer, sample_key, batch_size)
    symmetry = jax.random.randint(symmetry_key, (batch_size,), 0, len(perms))
    obs, legal, policy, action = jax.vmap(functools.partial(augment_position, game, perms))(
        symmetry, batch.obs, batch.legal, batch.policy, batch.action
    )

    def _loss(params):
        def apply(x):
            if not learner.batch_norm:
                return learner.apply({"params": params}, x, train=True), batch_stats
            variables = {"params": params, "batch_stats": batch_stats}
            outputs, updated = learner.apply(variables, x, train=True, mutable=["batch_stats"])
            return outputs, updated["batch_stats"]

        policy_loss, value_loss, new_stats = loss_fn(
            apply, batch, obs, legal, policy, action, targets, weights, hp.gamma
        )
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
    learner: nn.Module,
    loss_fn,
    game: str,
    perms: np.ndarray,
    batch_size: int,
    num_steps: int,
) -> LearnOutput:
    """3. Learn: `num_steps` SGD steps (`sgd_step`, B = batch_size positions each) on the
    buffer as it is after this iteration's targets. Losses are [num_steps]."""

    def _sgd_step(carry, key):
        output = sgd_step(
            *carry,
            buffer,
            hp,
            key,
            learner=learner,
            loss_fn=loss_fn,
            game=game,
            perms=perms,
            batch_size=batch_size,
        )
        return output[:3], output[3:]

    (params, batch_stats, opt_state), (policy_loss, value_loss) = jax.lax.scan(
        _sgd_step, (params, batch_stats, opt_state), jax.random.split(key, num_steps)
    )
    return LearnOutput(params, batch_stats, opt_state, policy_loss, value_loss)


def iteration_metrics(played: SelfPlayOutput, learned: LearnOutput, buffer, *, solo: bool) -> dict:
    """Scalar metrics of one iteration, reduced over devices; the self-play ones count the
    games that ended in this window (NaN where none did): their draw rate in two-player games,
    their score in a single-player one."""
    finished = device_sum(played.done.sum())
    per_game = jnp.where(finished > 0, finished, jnp.nan)
    ended = ("selfplay_score", played.score) if solo else ("selfplay_draw_rate", played.draw)
    return {
        "policy_loss": device_mean(learned.policy_loss.mean()),
        "value_loss": device_mean(learned.value_loss.mean()),
        "selfplay_games": finished.astype(jnp.float32),
        "selfplay_game_length": device_sum(jnp.sum(played.done * played.length)) / per_game,
        ended[0]: device_sum(jnp.sum(played.done * ended[1])) / per_game,
        "positions_with_target": device_sum(buffer.known.sum()).astype(jnp.float32),
    }


def iterate(
    state: TrainState, _, *, selfplay_fn, learn_fn, outcome: bool, batch_norm: bool, solo: bool
):
    """One AlphaZero iteration, a `lax.scan` body: self-play (`selfplay_fn`, `selfplay` bound)
    -> targets -> SGD (`learn_fn`, `learn` bound). A single-player game (`solo`) discounts by
    gamma between moves, a two-player one flips sides (-1). Returns (state, scalar metrics)."""
    hp = state.hparams
    variables = variables_of(state, batch_norm)
    key, selfplay_key, sgd_key = jax.random.split(state.key, 3)
    played = selfplay_fn(
        variables, hp, selfplay_key, state.games, state.game_length, state.game_score
    )
    discount = hp.gamma if solo else -1.0
    buffer = add_to_buffer(state.buffer, played.moves, hp.td_lambda, discount, outcome=outcome)
    learned = learn_fn(state.params, state.batch_stats, state.opt_state, buffer, hp, sgd_key)
    state = state._replace(
        params=learned.params,
        batch_stats=learned.batch_stats,
        opt_state=learned.opt_state,
        buffer=buffer,
        games=played.games,
        game_length=played.game_length,
        game_score=played.game_score,
        key=key,
        iteration=state.iteration + 1,
    )
    return state, iteration_metrics(played, learned, buffer, solo=solo)


def evaluate(state: TrainState, *, search_fn, evaluate_agent_fn, batch_norm: bool) -> dict:
    """4. Evaluation: the agent's greedy search (`search_fn`, `agent_search` bound) plays
    `evaluate_agent_fn` (utils/board_eval.py's `evaluate_agent` bound): matches from both
    seats against each opponent; for 2048 `game2048.evaluate_player`, whole games beside a
    random and an expectimax player's. Returns its scalar metrics (and game records). Its
    randomness comes from the state's key without advancing it: evaluating, or how often,
    changes nothing that training does, and the same state always plays the same games."""
    variables = variables_of(state, batch_norm)

    def agent(games, key):
        return search_fn(variables, state.hparams, key, games, greedy=True).action

    return evaluate_agent_fn(agent, jax.random.fold_in(state.key, EVALUATION_KEY_DATA))


def train_chunk(state: TrainState, num_updates: int, num_active=None, *, iterate_fn):
    """num_updates iterations (`iterate_fn`; the first num_active of them where given, see
    utils/trainer.py): (state, metrics [num_updates] each). The evaluation that ends the chunk,
    `evaluate`, is a program of its own, which the driver compiles beside this one and runs on
    the state this returns (Trainer.chunk_evaluation)."""
    return scan_updates(iterate_fn, state, num_updates, num_active)


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
        action=jnp.zeros(num_games, jnp.int32),
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
        game_score=zeros,
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
    game = resolve_game(config.env)
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
    require_positive(config, "eval_games", "eval_simulations", minimum=0)
    require_in(config, "gamma", 0.0, 1.0, above_low=True)
    require_in(config, "expectimax_depth", 1, 3)
    if game == "2048":
        validate_single_player(config)
    else:
        validate_board_game(config, game)
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
    if config.eval_games % (2 * num_devices) and game != "2048":
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


def validate_board_game(config: Config, game: str) -> None:
    """The settings of a two-player board game: no discount, and --eval-opponents with known
    names, each once, oracle only where a solver exists (tic_tac_toe)."""
    if config.gamma != 1.0:
        raise ConfigError(
            f"--gamma {config.gamma}: two-player games alternate sides between moves rather "
            "than discount; --gamma is for 2048"
        )
    names = config.eval_opponents
    unknown = [name for name in names if name not in OPPONENTS]
    if unknown or not names or len(set(names)) < len(names):
        raise ConfigError(
            f"--eval-opponents {' '.join(names) or '(none)'}: name each of {', '.join(OPPONENTS)} "
            "at most once, and at least one (--eval-games 0 turns the evaluation off)"
        )
    if "oracle" in names and game != "tic_tac_toe":
        raise ConfigError(
            f"--eval-opponents oracle: there is a perfect player for tic_tac_toe only, not {game}"
        )


def validate_single_player(config: Config) -> None:
    """The settings 2048 refuses: those of the two-player machinery it does not use."""
    if config.search != "puct":
        raise ConfigError(
            f"--search {config.search}: mctx has no Gumbel search with chance nodes, so 2048 "
            "searches with --search puct (its preset)"
        )
    if config.batch_norm:
        raise ConfigError("--batch-norm: 2048's MLP normalises with LayerNorm; use --no-batch-norm")
    if config.record_games:
        raise ConfigError(
            "--record-games draws board games against opponents; replay a 2048 run's game "
            "with --play RUN_DIR instead"
        )


def make_evaluate_agent(config: Config, env, num_devices: int, oracle_table):
    """(agent (games, key) -> moves, key) -> metrics: the in-loop evaluation on one device,
    and its opponents by name. Board games: matches against --eval-opponents (random, plain
    MCTS, tic_tac_toe's perfect player; utils/board_eval.py); 2048: whole games beside a
    random and an expectimax player (utils/game2048.py), no opponents. tic_tac_toe's
    evaluation judges the agent's moves against the perfect player's whichever it plays."""
    num_games = config.eval_games // num_devices
    if env.num_players == 1:
        return functools.partial(
            game2048.evaluate_player,
            env=env,
            num_games=num_games,
            max_moves=EVAL_MAX_MOVES,
            expectimax_depth=config.expectimax_depth,
        ), {}
    mcts_search = functools.partial(plain_search, env=env, num_simulations=config.baseline_sims)
    players = {
        name: player
        for name, player in opponents(env, mcts_search, oracle_table).items()
        if name in config.eval_opponents
    }
    return functools.partial(
        evaluate_agent,
        env=env,
        players=players,
        num_games=num_games,
        oracle_table=oracle_table,
        capture_video=config.record_games,
    ), players


def agent_simulations(config: Config) -> int:
    """Simulations per move of the evaluated agent, and of a trained run's agent in --play and
    --arena unless they are given there: --eval-simulations, or self-play's where it is 0."""
    return config.eval_simulations or config.num_simulations


def headline_metric(config: Config, solo: bool) -> str:
    """The score against the strongest opponent evaluated (2048: the game score); without an
    evaluation, self-play's value loss."""
    if not config.eval_games:
        return "value_loss"
    if solo:
        return "eval_score"
    strongest = [name for name in OPPONENTS if name in config.eval_opponents][-1]
    return f"eval_{strongest}_score"


def make_train(config: Config, runtime: Runtime | None = None) -> Trainer:
    """The stages bound to this run's static settings (game, network, sizes per device), and
    the Trainer the driver runs them with; without a runtime, for one run on one device."""
    runtime = runtime or Runtime()
    num_devices = runtime.num_devices
    game = resolve_game(config.env)
    env = pgx.make(game)
    num_actions, _ = game_shapes(env)
    perms = (
        action_permutations(game, num_actions) if config.augment else np.arange(num_actions)[None]
    )
    oracle_table = jax.device_put(solve_tic_tac_toe()) if game == "tic_tac_toe" else None
    on_cpu = runtime.backend == "cpu"
    network, learner = make_networks(
        config,
        env,
        one_run=runtime.num_runs == 1,
        on_cpu=on_cpu,
        one_core_each=on_cpu and available_cores() <= jax.local_device_count(),
    )

    search_fn = functools.partial(
        agent_search,
        env=env,
        network=network,
        search=config.search,
        num_simulations=config.num_simulations,
        max_num_considered_actions=config.max_num_considered_actions,
    )
    solo = env.num_players == 1  # 2048: single player, a tile spawn after every move
    iterate_fn = functools.partial(
        iterate,
        selfplay_fn=functools.partial(
            selfplay,
            env=env,
            search_fn=search_fn,
            rollout_steps=config.rollout_steps,
            stochastic=solo,
        ),
        learn_fn=functools.partial(
            learn,
            learner=learner,
            loss_fn=chance_loss if solo else board_loss,
            game=game,
            perms=perms,
            batch_size=config.minibatch_size // num_devices,
            num_steps=config.updates_per_iteration,
        ),
        outcome=config.value_target == "outcome",
        batch_norm=config.batch_norm,
        solo=solo,
    )
    evaluate_agent_fn, players = make_evaluate_agent(config, env, num_devices, oracle_table)
    evaluate_fn = functools.partial(
        evaluate,
        search_fn=functools.partial(search_fn, num_simulations=agent_simulations(config)),
        evaluate_agent_fn=evaluate_agent_fn,
        batch_norm=config.batch_norm,
    )
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
        train_chunk=functools.partial(train_chunk, iterate_fn=iterate_fn),
        evaluate=None,
        runtime=runtime,
        headline_metric=headline_metric(config, solo),
        step_unit="moves",
        updates_per_chunk=config.eval_every,
        write_records=functools.partial(write_game_records, env=env, opponent_names=tuple(players)),
        guarded_metrics=("policy_loss", "value_loss"),
        guarded_state=lambda state: (state.params, state.batch_stats, state.opt_state),
        # --eval-games 0: chunks end without an evaluation
        chunk_evaluation=evaluate_fn if config.eval_games else None,
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
