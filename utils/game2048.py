"""2048's rules split where the chance happens, for a search that plans through tile spawns,
and the evaluation of a 2048 player (score, highest tile, moves) beside a random and a plain
expectimax player.

A board is pgx's encoding: int32 [16], cell i = row i // 4, column i % 4, each cell the
exponent of its tile (0 empty, 1 for a 2, 2 for a 4, ...). A move is pgx's: 0 left, 1 up,
2 right, 3 down. One pgx step is `slide` (the player's move: tiles slide and merge, which
gives the afterstate and the merge reward) then `spawn` (chance: a 2 with probability 0.9 or
a 4 with probability 0.1 on a uniformly chosen empty cell). Chance outcome o puts exponent
1 + o % 2 on cell o // 2, so there are 32 outcomes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from utils.board_eval import random_player
from utils.devices import device_mean

NUM_CELLS = 16
NUM_MOVES = 4
NUM_OUTCOMES = 2 * NUM_CELLS
NUM_EXPONENTS = 31  # pgx's observation: one channel per exponent 0..30
SPAWN_PROBABILITIES = (0.9, 0.1)  # a 2, a 4
REACHED_TILES = (512, 1024, 2048)  # evaluation: the share of games that reach each

# Move a slides every row of the board turned by a quarter turns (np.rot90, as pgx does) to
# the left: row-major cells of the turned board, and where each goes back to.
_TURNED = np.stack([np.rot90(np.arange(NUM_CELLS).reshape(4, 4), a).ravel() for a in range(4)])
_UNTURNED = np.argsort(_TURNED, axis=1)


def _compact(rows):
    """Tiles of each row [..., 4] moved left, keeping their order."""
    order = jnp.argsort(rows == 0, axis=-1, stable=True)
    return jnp.take_along_axis(rows, order, axis=-1)


def _slide_rows_left(rows):
    """(rows [4, 4] slid and merged left, merge reward): each pair of equal neighbours merges
    once, leftmost pair first, as in the original game."""
    c = _compact(rows)
    c0, c1, c2, c3 = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
    m0 = (c0 > 0) & (c0 == c1)
    m1 = ~m0 & (c1 > 0) & (c1 == c2)
    m2 = ~m1 & (c2 > 0) & (c2 == c3)
    merged = jnp.stack(
        [
            c0 + m0,
            jnp.where(m0, 0, c1 + m1),
            jnp.where(m1, 0, c2 + m2),
            jnp.where(m2, 0, c3),
        ],
        axis=-1,
    )
    gained = jnp.stack([m0, m1, m2], -1) * jnp.left_shift(1, c[:, :3] + 1)
    return _compact(merged), gained.sum().astype(jnp.float32)


def slide(board, move):
    """The player's move on one board [16]: (afterstate [16], merge reward [] float32, whether
    any tile moved [] bool; a move that moves nothing is illegal)."""
    board = jnp.asarray(board)
    turned = board[jnp.asarray(_TURNED)[move]].reshape(4, 4)
    rows, reward = _slide_rows_left(turned)
    after = rows.ravel()[jnp.asarray(_UNTURNED)[move]]
    return after, reward, jnp.any(after != board)


def legal_moves(board):
    """[4] bool: the moves that move a tile. None left ends the game."""
    return jax.vmap(lambda move: slide(board, move)[2])(jnp.arange(NUM_MOVES))


def spawn_probabilities(after):
    """[32] float32 probability of each chance outcome at the afterstate [16]; all zero on a
    full board, which no legal move leaves."""
    empty = (after == 0).astype(jnp.float32)
    share = empty / jnp.maximum(empty.sum(), 1.0)
    return (share[:, None] * jnp.asarray(SPAWN_PROBABILITIES, jnp.float32)).ravel()


def spawn(after, outcome):
    """The board [16] after chance outcome `outcome` (exponent 1 + outcome % 2 on cell
    outcome // 2) at the afterstate [16]."""
    return after.at[outcome // 2].set(1 + outcome % 2)


def observation(board):
    """pgx's observation of a board [16]: (4, 4, 31) bool, channel k marks exponent k."""
    return jax.nn.one_hot(board, NUM_EXPONENTS, dtype=jnp.bool_).reshape(4, 4, NUM_EXPONENTS)


def board_of(obs):
    """The board [16] int32 that a pgx observation (4, 4, 31) shows."""
    return jnp.argmax(obs.reshape(NUM_CELLS, NUM_EXPONENTS), axis=-1).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# Players and evaluation
# ---------------------------------------------------------------------------------------------


def expectimax_value(board, depth: int):
    """The expected merge reward of the best `depth` moves from a board [16], averaging over
    every spawn between them, with nothing counted past the game's end: plain expectimax, no
    heuristic. Returns ([4] value of each move, -inf for illegal ones; [] the best)."""

    def move_value(move):
        after, reward, moved = slide(board, move)
        if depth == 1:
            future = jnp.float32(0.0)
        else:
            probabilities = spawn_probabilities(after)
            outcomes = jnp.arange(NUM_OUTCOMES)
            futures = jax.vmap(lambda o: expectimax_value(spawn(after, o), depth - 1)[1])(outcomes)
            future = jnp.sum(jnp.where(probabilities > 0, probabilities * futures, 0.0))
        return jnp.where(moved, reward + future, -jnp.inf)

    values = jax.vmap(move_value)(jnp.arange(NUM_MOVES))
    best = jnp.max(values)
    return values, jnp.where(jnp.isfinite(best), best, 0.0)


def expectimax_player(games, key, *, depth: int):
    """The move of greatest expected merge reward over the next `depth` moves
    (`expectimax_value`) for each of the games [B]; ties go to the lowest move."""
    del key
    values, _ = jax.vmap(lambda obs: expectimax_value(board_of(obs), depth))(games.observation)
    return jnp.argmax(values, axis=-1)


def play_games(env, player: Callable, key, *, num_games: int, max_moves: int):
    """num_games games of pgx's 2048, each to its end or `max_moves` moves, `player` (games
    [B], key) -> moves [B] choosing every move. Returns (score [B], highest tile [B], moves
    [B]), all int32."""
    init_key, key = jax.random.split(key)
    games = jax.vmap(env.init)(jax.random.split(init_key, num_games))
    zeros = jnp.zeros(num_games, jnp.int32)

    def _not_done(carry):
        games, _, moves, _ = carry
        return jnp.any(~games.terminated & (moves < max_moves))

    def _move(carry):
        games, score, moves, key = carry
        key, move_key, spawn_key = jax.random.split(key, 3)
        playing = ~games.terminated & (moves < max_moves)
        action = player(games, move_key)
        after = jax.vmap(env.step)(games, action, jax.random.split(spawn_key, num_games))
        games = jax.tree.map(
            lambda new, old: jnp.where(playing.reshape(-1, *[1] * (old.ndim - 1)), new, old),
            after,
            games,
        )
        score = score + jnp.where(playing, after.rewards[:, 0], 0).astype(jnp.int32)
        return games, score, moves + playing, key

    games, score, moves, _ = jax.lax.while_loop(_not_done, _move, (games, zeros, zeros, key))
    highest = jnp.left_shift(1, jax.vmap(board_of)(games.observation).max(axis=-1))
    return score, highest, moves


def evaluate_player(
    agent: Callable, key, *, env, num_games: int, max_moves: int, expectimax_depth: int
) -> dict:
    """The agent's games and, on other games, a random player's and a depth-`expectimax_depth`
    expectimax player's: mean score, highest tile and moves per game, and the share of the
    agent's games that reach 512, 1024 and 2048. Means are over all devices' games."""
    agent_key, random_key, expectimax_key = jax.random.split(key, 3)
    run = functools.partial(play_games, env, num_games=num_games, max_moves=max_moves)
    score, highest, moves = run(agent, agent_key)
    metrics = {
        "eval_score": score.mean(),
        "eval_max_tile": highest.mean(),
        "eval_moves": moves.mean(),
        **{f"eval_reach_{tile}": (highest >= tile).mean() for tile in REACHED_TILES},
        "eval_random_score": run(random_player, random_key)[0].mean(),
        "eval_expectimax_score": run(
            functools.partial(expectimax_player, depth=expectimax_depth), expectimax_key
        )[0].mean(),
    }
    return {name: device_mean(value.astype(jnp.float32)) for name, value in metrics.items()}
