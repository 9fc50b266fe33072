"""Evaluation of an agent for two-player pgx board games, inside jit: matches against fixed
opponents from both seats, win/draw/loss and Elo per opponent, the share of optimal moves
where a solver exists (tic_tac_toe), and SVG records of the games for --capture-video.

The agent is a function `agent(games, key) -> actions` on a batch of pgx states [B]; so is
every opponent. It runs under the driver's `pmap(vmap(...))`, one seed on one device: the
counts are summed over DEVICE_AXIS.

The opponents, in the order the metrics and game records name them:
- random: a uniformly random legal move;
- mcts: plain MCTS, uniform priors and values from one random rollout, with the search that
  the caller passes in (`mcts_search`, PUCT with the real game as its model);
- oracle (tic_tac_toe only): a perfect player, uniform among the optimal moves.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pgx

from utils.devices import device_sum

MAX_RECORDED_MOVES = 512  # a game record for --capture-video keeps at most this many moves
OPPONENTS = ("random", "mcts", "oracle")  # `opponents`' names, weakest first


# ---------------------------------------------------------------------------------------------
# Values: random rollouts, the tic_tac_toe solver, Elo
# ---------------------------------------------------------------------------------------------


def random_rollout_value(env, state, key):
    """The result of playing uniformly random legal moves to the end of the game, from the side
    of `state`'s player to move (0 for positions that are already over). Batched states [B]
    -> [B]."""
    batch = state.current_player.shape[0]
    player = state.current_player

    def _not_done(carry):
        state, _, _ = carry
        return ~jnp.all(state.terminated | state.truncated)

    def _random_move(carry):
        state, key, total = carry
        key, move_key = jax.random.split(key)
        logits = jnp.where(state.legal_action_mask, 0.0, -jnp.inf)
        action = jax.random.categorical(move_key, logits)
        state = jax.vmap(env.step)(state, action)  # finished games stay as they are
        return state, key, total + state.rewards[jnp.arange(batch), player]

    _, _, total = jax.lax.while_loop(_not_done, _random_move, (state, key, jnp.zeros(batch)))
    return total


def solve_tic_tac_toe() -> np.ndarray:
    """Exact minimax action values of every tic_tac_toe position, from the mover's side:
    [3**9, 9] int8, +1 win / 0 draw / -1 loss with perfect play, -2 for occupied cells. A
    position's index is sum(cell * 3**i) over the cells in row-major order, with cell 0 empty,
    1 the mover's mark and 2 the opponent's."""
    lines = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]
    lines_through = [[line for line in lines if cell in line] for cell in range(9)]
    table = np.full((3**9, 9), -2, np.int8)

    @functools.cache
    def action_values(board: tuple[int, ...]) -> tuple[int, ...]:
        values = []
        for cell in range(9):
            if board[cell]:
                values.append(-2)
                continue
            after = (*board[:cell], 1, *board[cell + 1 :])
            # a move can only complete a line through its own cell
            if any(all(after[i] == 1 for i in line) for line in lines_through[cell]):
                values.append(1)
            elif all(after):
                values.append(0)
            else:  # the opponent moves next, with the marks seen from their side
                flipped = tuple((3 - c) % 3 for c in after)
                values.append(-max(action_values(flipped)))
        table[sum(c * 3**i for i, c in enumerate(board))] = values
        return tuple(values)

    action_values((0,) * 9)
    return table


def tic_tac_toe_index(obs):
    """Index into `solve_tic_tac_toe()` of pgx tic_tac_toe observations [..., 3, 3, 2] (channel
    0: the mover's marks, 1: the opponent's) -> [...]."""
    cells = (obs[..., 0].astype(jnp.int32) + 2 * obs[..., 1].astype(jnp.int32)).reshape(
        *obs.shape[:-3], 9
    )
    return jnp.sum(cells * (3 ** jnp.arange(9)), axis=-1)


def elo_estimate(wins, draws, losses):
    """Elo difference to the opponent from game counts, with a 95% interval from the score's
    standard error. Scores are clipped half a game from 0 and 1 so that a clean sweep stays
    finite. Returns (elo, low, high)."""
    games = jnp.maximum(wins + draws + losses, 1.0)
    score = (wins + 0.5 * draws) / games
    variance = (wins + 0.25 * draws) / games - score**2
    margin = 1.96 * jnp.sqrt(jnp.maximum(variance, 0.0) / games)
    clip = 0.5 / games

    def elo(s):
        s = jnp.clip(s, clip, 1.0 - clip)
        return 400.0 * jnp.log10(s / (1.0 - s))

    return elo(score), elo(score - margin), elo(score + margin)


# ---------------------------------------------------------------------------------------------
# Opponents: (games [B], key) -> actions [B]
# ---------------------------------------------------------------------------------------------


def random_player(games, key):
    """A uniformly random legal move."""
    return jax.random.categorical(key, jnp.where(games.legal_action_mask, 0.0, -jnp.inf))


def mcts_player(games, key, *, env, search: Callable):
    """Plain MCTS: uniform priors, values from one random rollout, and `search(key, games,
    root_logits, root_value, evaluate_position) -> actions`, where `evaluate_position(params,
    key, games) -> (logits [B, num_actions], value [B])` values a position for the search."""
    batch = games.current_player.shape[0]

    def evaluate_by_rollout(params, key, state):
        return jnp.zeros((batch, env.num_actions)), random_rollout_value(env, state, key)

    search_key, rollout_key = jax.random.split(key)
    root_value = random_rollout_value(env, games, rollout_key)
    root_logits = jnp.zeros((batch, env.num_actions))
    return search(search_key, games, root_logits, root_value, evaluate_by_rollout)


def oracle_player(games, key, *, table):
    """A perfect tic_tac_toe player that picks uniformly among the optimal moves; `table` is
    `solve_tic_tac_toe()` as a device array."""
    values = table[tic_tac_toe_index(games.observation)]
    best = values == jnp.max(values, axis=-1, keepdims=True)
    return jax.random.categorical(key, jnp.where(best, 0.0, -jnp.inf))


def opponents(env, mcts_search: Callable, oracle_table) -> dict[str, Callable]:
    """The opponents by name: random, mcts with `mcts_search` (see `mcts_player`) and, where
    `oracle_table` is not None (tic_tac_toe), oracle."""
    players = {
        "random": random_player,
        "mcts": functools.partial(mcts_player, env=env, search=mcts_search),
    }
    if oracle_table is not None:
        players["oracle"] = functools.partial(oracle_player, table=oracle_table)
    return players


# ---------------------------------------------------------------------------------------------
# Matches and their metrics
# ---------------------------------------------------------------------------------------------


class MatchOutput(NamedTuple):
    """One match of H = num_games // 2 games per seat against one opponent."""

    result: jax.Array  # [2, H] the agent's result (+1/0/-1); row 0: the agent moved first
    optimal: jax.Array  # [] int32 agent moves the oracle judges optimal (0 without an oracle)
    judged: jax.Array  # [] int32 agent moves the oracle judged
    record_keys: jax.Array  # [2, *key_shape] initial key of each seat's first game
    record_moves: jax.Array  # [2, MAX_RECORDED_MOVES or 0] its moves, -1 once it ended


def play_against(
    agent: Callable,
    opponent_index,
    key,
    *,
    env,
    players: Sequence[Callable],
    num_games: int,
    oracle_table,
    capture_video: bool,
) -> MatchOutput:
    """`num_games` games of `agent` against `players[opponent_index]`, as two lock-step halves:
    the agent moves first in half 0 and second in half 1. Players alternate, so at every ply
    the agent is to move in all running games of one half and the opponent in all of the
    other: each side searches only the games where it moves. With `oracle_table`, the agent's
    moves are judged against it; with `capture_video`, the first game of each half is
    recorded."""
    half = num_games // 2
    init_key, loop_key = jax.random.split(key)
    game_keys = jax.random.split(init_key, 2 * half)
    games = jax.vmap(env.init)(game_keys)
    games = jax.tree.map(lambda x: x.reshape(2, half, *x.shape[1:]), games)
    agent_player = jnp.stack([games.current_player[0], 1 - games.current_player[1]])
    index = jnp.arange(half)

    def _not_done(carry):
        games = carry[0]
        return ~jnp.all(games.terminated | games.truncated)

    def _ply(carry):
        games, ply, key, result, optimal, judged, record = carry
        key, agent_key, opponent_key = jax.random.split(key, 3)
        agent_side = ply % 2  # the half where the agent is to move
        agent_games = jax.tree.map(lambda x: x[agent_side], games)
        other_games = jax.tree.map(lambda x: x[1 - agent_side], games)
        agent_action = agent(agent_games, agent_key)
        other_action = jax.lax.switch(opponent_index, list(players), other_games, opponent_key)
        actions = jnp.where(
            agent_side == 0,
            jnp.stack([agent_action, other_action]),
            jnp.stack([other_action, agent_action]),
        )
        if oracle_table is not None:
            running = ~(agent_games.terminated | agent_games.truncated)
            values = oracle_table[tic_tac_toe_index(agent_games.observation)]
            is_best = values[index, agent_action] == jnp.max(values, axis=-1)
            optimal = optimal + jnp.sum(running & is_best)
            judged = judged + jnp.sum(running)
        if capture_video:  # the moves of each half's first game, -1 once it ended
            first_running = ~(games.terminated | games.truncated)[:, 0]
            move = jnp.where(first_running, actions[:, 0], -1)
            record = record.at[:, jnp.minimum(ply, MAX_RECORDED_MOVES - 1)].set(
                jnp.where(ply < MAX_RECORDED_MOVES, move, record[:, -1])
            )
        games = jax.vmap(jax.vmap(env.step))(games, actions)  # finished games stay put
        reward = jnp.take_along_axis(games.rewards, agent_player[..., None], axis=-1)[..., 0]
        return games, ply + 1, key, result + reward, optimal, judged, record

    record = jnp.full((2, MAX_RECORDED_MOVES if capture_video else 0), -1, jnp.int32)
    carry = (games, jnp.int32(0), loop_key, jnp.zeros((2, half)), jnp.int32(0), jnp.int32(0))
    carry = (*carry, record)
    _, _, _, result, optimal, judged, record = jax.lax.while_loop(_not_done, _ply, carry)
    return MatchOutput(result, optimal, judged, game_keys[jnp.array([0, half])], record)


def match_metrics(name: str, results) -> dict:
    """eval_{name}_win/draw/loss/score (shares of all devices' games) and _elo/_elo_low/
    _elo_high from the agent's results [2, H] against opponent `name`."""
    wins, draws, losses = (
        device_sum(jnp.sum(results == r).astype(jnp.float32)) for r in (1, 0, -1)
    )
    games = wins + draws + losses
    elo, low, high = elo_estimate(wins, draws, losses)
    return {
        f"eval_{name}_win": wins / games,
        f"eval_{name}_draw": draws / games,
        f"eval_{name}_loss": losses / games,
        f"eval_{name}_score": (wins + 0.5 * draws) / games,
        f"eval_{name}_elo": elo,
        f"eval_{name}_elo_low": low,
        f"eval_{name}_elo_high": high,
    }


def evaluate_agent(
    agent: Callable,
    key,
    *,
    env,
    players: dict[str, Callable],
    num_games: int,
    oracle_table,
    capture_video: bool,
) -> dict:
    """`num_games` games (half in each seat) of `agent(games, key) -> actions` against each of
    `players` (from `opponents`). Returns scalar metrics, `match_metrics` per opponent and,
    with `oracle_table`, eval_optimal_move_rate; with `capture_video` also record_keys
    [opponents, 2, *key_shape] and record_moves [opponents, 2, MAX_RECORDED_MOVES] for
    `write_game_records`."""
    play = functools.partial(
        play_against,
        agent,
        env=env,
        players=list(players.values()),
        num_games=num_games,
        oracle_table=oracle_table,
        capture_video=capture_video,
    )

    # A scan over opponents traces the agent once, and its index stays unbatched under the
    # seed vmap, so `lax.switch` runs only the opponent it names.
    def _play(_, opponent_key):
        opponent_index, key = opponent_key
        return None, play(opponent_index, key)

    num_opponents = len(players)
    _, match = jax.lax.scan(
        _play, None, (jnp.arange(num_opponents), jax.random.split(key, num_opponents))
    )
    metrics = {}
    if capture_video:  # [opponents, seats, ...]: replayed on the host into SVGs
        metrics["record_keys"], metrics["record_moves"] = match.record_keys, match.record_moves
    for i, name in enumerate(players):
        metrics.update(match_metrics(name, match.result[i]))
    if oracle_table is not None:
        optimal_total = device_sum(match.optimal.sum())
        judged_total = device_sum(match.judged.sum())
        metrics["eval_optimal_move_rate"] = optimal_total / jnp.maximum(judged_total, 1)
    return metrics


# ---------------------------------------------------------------------------------------------
# Game records (host side)
# ---------------------------------------------------------------------------------------------


def write_game_records(
    run_dir: str, update: int, records: dict, *, env, opponent_names: Sequence[str]
) -> list[str]:
    """One SVG animation per opponent and seat of the evaluation that ended at `update`,
    replayed from the game's initial key and its moves with pgx's own renderer, into
    RUN_DIR/games/. `records` holds one seed's record_keys and record_moves."""
    os.makedirs(os.path.join(run_dir, "games"), exist_ok=True)
    paths = []
    for i, opponent in enumerate(opponent_names):
        for seat, seat_name in enumerate(("first", "second")):
            name = f"iteration{update:06d}_{opponent}_agent_{seat_name}.svg"
            path = os.path.join(run_dir, "games", name)
            save_game_svg(
                env, records["record_keys"][i, seat], records["record_moves"][i, seat], path
            )
            paths.append(path)
    return paths


def save_game_svg(env, key, moves, path: str) -> None:
    """The game that starts from `env.init(key)` and plays `moves` (-1 once it ended) as an
    SVG animation at `path` (pgx's renderer), written whole or not at all."""
    step = _jitted_step(env)
    state = env.init(key)
    states = [state]
    for move in moves:
        if move < 0:
            break
        state = step(state, jnp.int32(move))
        states.append(state)
    pgx.save_svg_animation(states, path + ".tmp", frame_duration_seconds=0.5)
    os.replace(path + ".tmp", path)


@functools.cache
def _jitted_step(env):
    return jax.jit(env.step)
