"""utils/board_eval.py: the tic_tac_toe solver, random rollouts and Elo against plain
references, and a whole evaluation of a perfect agent with its game records."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pgx
import pytest

from purejaxrl_az import plain_search
from utils.board_eval import (
    MAX_RECORDED_MOVES,
    elo_estimate,
    evaluate_agent,
    opponents,
    oracle_player,
    random_rollout_value,
    solve_tic_tac_toe,
    tic_tac_toe_index,
    write_game_records,
)
from utils.devices import DEVICE_AXIS


def test_tic_tac_toe_oracle():
    table = solve_tic_tac_toe()
    assert (table[0] == 0).all()  # every first move draws with perfect play
    # Mover holds cells 0 and 1, the opponent 3 and 4: cell 2 wins, cell 5 only draws,
    # anything else loses.
    index = 1 * 1 + 1 * 3 + 2 * 27 + 2 * 81
    values = table[index]
    assert values[2] == 1 and values[5] == 0 and values[6] == -1 and values[0] == -2
    # The index matches pgx's observation layout: the oracle never loses to random play.
    env = pgx.make("tic_tac_toe")
    step = jax.jit(jax.vmap(env.step))
    state = jax.vmap(env.init)(jax.random.split(jax.random.PRNGKey(0), 200))
    oracle_player = jnp.arange(200) % 2
    key = jax.random.PRNGKey(1)
    result = jnp.zeros(200)
    for _ in range(9):
        key, k = jax.random.split(key)
        random_action = jax.random.categorical(k, jnp.where(state.legal_action_mask, 0.0, -jnp.inf))
        best = jnp.argmax(jnp.asarray(table)[tic_tac_toe_index(state.observation)], axis=-1)
        action = jnp.where(state.current_player == oracle_player, best, random_action)
        state = step(state, action)
        result = result + state.rewards[jnp.arange(200), oracle_player]
    assert bool(jnp.all(state.terminated))
    assert float(result.min()) >= 0.0 and float(result.mean()) > 0.5


LINES = [(0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6)]


def random_play_value(board):
    """Exact expected result of uniformly random play for the mover (cells: 1 mover, 2 other)."""
    empty = [c for c in range(9) if board[c] == 0]
    total = 0.0
    for cell in empty:
        after = list(board)
        after[cell] = 1
        if any(all(after[i] == 1 for i in line) for line in LINES):
            total += 1.0
        elif len(empty) > 1:
            total -= random_play_value([(3 - c) % 3 for c in after])
    return total / len(empty)


def test_random_rollout_value_is_the_movers_expected_result():
    env = pgx.make("tic_tac_toe")
    state = env.init(jax.random.PRNGKey(0))
    for action in (0, 3, 1, 4):  # X: 0, 1; O: 3, 4; X to move
        state = env.step(state, jnp.int32(action))
    batch = jax.tree.map(lambda x: jnp.broadcast_to(x, (4000, *x.shape)), state)
    rollout = jax.jit(lambda states, key: random_rollout_value(env, states, key))
    values = np.asarray(rollout(batch, jax.random.PRNGKey(0)))
    assert set(np.unique(values)) <= {-1.0, 0.0, 1.0}
    expected = random_play_value([1, 1, 0, 2, 2, 0, 0, 0, 0])
    assert values.mean() == pytest.approx(expected, abs=4 * values.std() / np.sqrt(4000))
    won = jax.jit(jax.vmap(env.step))(batch, jnp.full(4000, 2))  # X completes the top row
    np.testing.assert_array_equal(np.asarray(rollout(won, jax.random.PRNGKey(0))), 0.0)


def test_elo_estimate():
    elo, low, high = elo_estimate(jnp.float32(30), jnp.float32(40), jnp.float32(30))
    assert float(elo) == pytest.approx(0.0, abs=1e-3) and float(low) < 0 < float(high)
    elo, _, _ = elo_estimate(jnp.float32(75), jnp.float32(0), jnp.float32(25))
    assert float(elo) == pytest.approx(400 * np.log10(3), rel=1e-4)
    elo, low, high = elo_estimate(jnp.float32(10), jnp.float32(0), jnp.float32(0))
    assert np.isfinite(float(elo)) and float(low) <= float(elo) <= float(high)


def test_a_perfect_agent_never_loses_plays_only_optimal_moves_and_is_filmed(tmp_path):
    """The oracle as the agent, 16 games against each opponent on one device: no loss, only
    draws against itself, every move judged optimal, and one SVG per opponent and seat."""
    env = pgx.make("tic_tac_toe")
    table = jnp.asarray(solve_tic_tac_toe())
    players = opponents(env, functools.partial(plain_search, env=env, num_simulations=8), table)
    assert list(players) == ["random", "mcts", "oracle"]
    evaluate = functools.partial(
        evaluate_agent,
        functools.partial(oracle_player, table=table),
        env=env,
        players=players,
        num_games=16,
        oracle_table=table,
        capture_video=True,
    )
    keys = jax.random.split(jax.random.PRNGKey(0), 1)  # one device
    metrics = jax.jit(jax.vmap(evaluate, axis_name=DEVICE_AXIS))(keys)
    metrics = jax.tree.map(lambda x: np.asarray(x[0]), metrics)
    for name in players:
        shares = [metrics[f"eval_{name}_{r}"] for r in ("win", "draw", "loss")]
        assert sum(shares) == pytest.approx(1.0) and shares[2] == 0.0, (name, shares)
        elo, low, high = (metrics[f"eval_{name}_elo{s}"] for s in ("", "_low", "_high"))
        assert low <= elo <= high
    assert metrics["eval_oracle_draw"] == 1.0
    assert metrics["eval_optimal_move_rate"] == 1.0
    assert metrics["record_moves"].shape == (3, 2, MAX_RECORDED_MOVES)
    moves_made = (metrics["record_moves"] >= 0).sum(-1)
    assert moves_made.min() >= 5 and moves_made.max() <= 9  # whole tic_tac_toe games
    paths = write_game_records(str(tmp_path), 7, metrics, env=env, opponent_names=tuple(players))
    assert [os.path.basename(p) for p in paths] == [
        f"iteration000007_{name}_agent_{seat}.svg"
        for name in players
        for seat in ("first", "second")
    ]
    for path in paths:
        with open(path) as f:
            assert "<svg" in f.read()
