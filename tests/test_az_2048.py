"""2048 with chance nodes: the rules the search plans with against pgx's own step and the
original game's, the chance model mctx searches, the value scale, the expectimax baseline,
and the whole trainer on 2048."""

import functools
import io
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pgx
import pytest
import scipy.stats

import purejaxrl_az
from purejaxrl_az import (
    PRESETS,
    Board,
    Config,
    HyperParams,
    MLPNet,
    _dihedral,
    action_permutations,
    agent_search,
    augment_position,
    inverse_value_transform,
    make_chance_model,
    make_train,
    resolve_game,
    two_hot,
    validate,
    value_of,
    value_transform,
)
from tests.helpers import TINY_AZ
from utils import board_play, game2048
from utils.board_eval import random_player
from utils.cli import parse_config
from utils.driver import run_training
from utils.errors import ConfigError
from utils.trainer import hyperparams_of

ENV = pgx.make("2048")


def reference_move(board, move):
    """The original game's move, written from its rules: each row, turned as pgx turns it for
    the move, loses its gaps, then equal neighbours merge once each, from the left."""
    grid = np.rot90(np.asarray(board).reshape(4, 4), move)
    rows, reward = [], 0
    for row in grid:
        tiles, merged = [t for t in row if t], []
        while tiles:
            if len(tiles) > 1 and tiles[0] == tiles[1]:
                merged.append(tiles[0] + 1)
                reward += 2 ** (tiles[0] + 1)
                tiles = tiles[2:]
            else:
                merged.append(tiles.pop(0))
        rows.append(merged + [0] * (4 - len(merged)))
    return np.rot90(np.array(rows), -move).ravel(), reward


def random_boards(num, seed=0, fill=0.6):
    rng = np.random.default_rng(seed)
    exponents = rng.integers(1, 8, (num, 16))
    return np.where(rng.random((num, 16)) < fill, exponents, 0).astype(np.int32)


def test_slide_follows_the_original_rules():
    boards = random_boards(300)
    boards[:4] = [[1, 1, 1, 1] * 4, [2, 0, 2, 2] * 4, [0] * 16, [1, 2, 3, 4] * 4]
    slide = jax.jit(jax.vmap(game2048.slide, in_axes=(0, None)))
    for move in range(4):
        after, reward, moved = map(np.asarray, slide(boards, move))
        for board, got, got_reward, got_moved in zip(boards, after, reward, moved, strict=True):
            want, want_reward = reference_move(board, move)
            np.testing.assert_array_equal(got, want)
            assert got_reward == want_reward and got_moved == (want != board).any()
    legal = np.asarray(jax.vmap(game2048.legal_moves)(boards))
    moved = np.stack([np.asarray(slide(boards, move)[2]) for move in range(4)], axis=-1)
    np.testing.assert_array_equal(legal, moved)


def test_a_move_then_its_spawn_is_pgx_step():
    """pgx steps 256 games 150 random moves; at each step its new board is our afterstate plus
    exactly one tile, a 2 or a 4 on an empty cell, and spawning that outcome gives pgx's board,
    reward, legal moves and game end."""

    @jax.jit
    def check(games, key):
        move_key, step_key = jax.random.split(key)
        move = random_player(games, move_key)
        board = jax.vmap(game2048.board_of)(games.observation)
        after, reward, moved = jax.vmap(game2048.slide)(board, move)
        stepped = jax.vmap(ENV.step)(games, move, jax.random.split(step_key, move.shape[0]))
        new = jax.vmap(game2048.board_of)(stepped.observation)
        cell = jnp.argmax(new != after, axis=-1)
        outcome = 2 * cell + new[jnp.arange(move.shape[0]), cell] - 1
        spawned = jax.vmap(game2048.spawn)(after, outcome)
        legal = jax.vmap(game2048.legal_moves)(new)
        ok = (
            moved
            & (jnp.sum(new != after, axis=-1) == 1)
            & (after[jnp.arange(move.shape[0]), cell] == 0)
            & jnp.all(spawned == new, axis=-1)
            & (reward == stepped.rewards[:, 0])
            & (stepped.terminated == ~jnp.any(legal, axis=-1))
            & (jnp.all(legal == stepped.legal_action_mask, axis=-1) | stepped.terminated)
        )
        return stepped, jnp.sum(~games.terminated & ~ok), jnp.sum(~games.terminated)

    games = jax.vmap(ENV.init)(jax.random.split(jax.random.PRNGKey(0), 256))
    checked = 0
    for key in jax.random.split(jax.random.PRNGKey(1), 150):
        games, bad, playing = check(games, key)
        assert int(bad) == 0
        checked += int(playing)
    assert checked > 20_000


def test_the_8_symmetries_map_moves_so_that_slides_commute_with_them():
    """Under each board symmetry, augment_position's move slides the transformed board into
    the transformed afterstate, and the legal mask and policy follow the moves."""
    perms = action_permutations("2048", 4)
    assert len(perms) == 8 and sorted(map(tuple, perms)) == sorted(set(map(tuple, perms)))
    rng = np.random.default_rng(5)
    for board in random_boards(10, seed=1):
        obs, legal = game2048.observation(board), game2048.legal_moves(board)
        policy = jnp.asarray(rng.random(4), jnp.float32)
        for k in range(8):
            for move in range(4):
                new_obs, new_legal, new_policy, new_move = augment_position(
                    "2048", perms, k, obs, legal, policy, jnp.int32(move)
                )
                new_board = game2048.board_of(new_obs)
                after, reward, _ = game2048.slide(jnp.asarray(board), move)
                new_after, new_reward, _ = game2048.slide(new_board, new_move)
                np.testing.assert_array_equal(
                    game2048.observation(new_after), _dihedral(game2048.observation(after), k)
                )
                assert float(new_reward) == float(reward)
                assert bool(new_legal[new_move]) == bool(legal[move])
                assert float(new_policy[new_move]) == float(policy[move])
            np.testing.assert_array_equal(new_legal, game2048.legal_moves(new_board))


def test_pgx_spawns_as_often_as_the_chance_model_says():
    """Chi-square of 20,000 of pgx's spawns after one move against `spawn_probabilities`."""
    board = jnp.asarray([1, 2, 3, 1, 0, 4, 5, 0, 2, 0, 6, 1, 3, 2, 0, 7], jnp.int32)
    state = ENV.init(jax.random.PRNGKey(0))
    state = state.replace(_board=board, legal_action_mask=game2048.legal_moves(board))
    move = 0
    after, _, _ = game2048.slide(board, move)
    keys = jax.random.split(jax.random.PRNGKey(2), 20_000)
    new = jax.jit(jax.vmap(lambda key: game2048.board_of(ENV.step(state, move, key).observation)))(
        keys
    )
    cell = np.argmax(np.asarray(new != after), axis=-1)
    outcome = 2 * cell + np.asarray(new)[np.arange(len(cell)), cell] - 1
    probabilities = np.asarray(game2048.spawn_probabilities(after))
    assert probabilities.sum() == pytest.approx(1.0)
    assert np.all(probabilities[2 * np.flatnonzero(np.asarray(after) != 0)] == 0)
    possible = probabilities > 0
    observed = np.bincount(outcome, minlength=game2048.NUM_OUTCOMES)
    assert observed[~possible].sum() == 0
    _, p_value = scipy.stats.chisquare(observed[possible], probabilities[possible] * len(keys))
    assert p_value > 1e-3


def test_the_chance_model_is_the_rules_with_the_networks_values():
    """mctx's two functions with a constant network (state value 10, afterstate value 20):
    legal move, illegal move, spawn, and a spawn that ends the game."""
    gamma = 0.9

    def evaluate_board(params, boards):
        size = boards.shape[0]
        return jnp.zeros((size, 4)), jnp.full(size, 10.0), jnp.full(size, 20.0)

    decision, chance = make_chance_model(evaluate_board, gamma)
    board = jnp.asarray([[1, 1, 2, 0] + [0] * 12, [1, 2, 1, 2] * 2 + [2, 1, 2, 1] * 2])
    key = jax.random.PRNGKey(0)
    output, after = decision(None, key, jnp.asarray([0, 0]), Board(board, jnp.zeros(2, bool)))
    np.testing.assert_array_equal(after.board[0], reference_move(board[0], 0)[0])
    assert float(after.reward[0]) == 4.0 and not bool(after.dead[0])
    assert bool(after.dead[1])  # a full checkerboard: nothing moves
    np.testing.assert_allclose(output.afterstate_value, [4.0 + gamma * 20.0, 0.0])
    np.testing.assert_allclose(
        jax.nn.softmax(output.chance_logits[0]),
        game2048.spawn_probabilities(after.board[0]),
        rtol=1e-6,
    )
    output, state = chance(None, key, jnp.asarray([9, 0]), after)  # a 4 on cell 4
    np.testing.assert_array_equal(state.board[0], game2048.spawn(after.board[0], 9))
    np.testing.assert_allclose(output.reward, [4.0, 0.0])  # the merge reward comes here
    np.testing.assert_allclose(output.discount, [gamma, 0.0])
    np.testing.assert_allclose(output.value, [10.0, 0.0])
    # A 2 in the last empty cell leaves no move: the game ends there.
    full = jnp.asarray([[1, 2, 1, 2, 2, 1, 2, 1, 1, 2, 1, 2, 2, 1, 2, 0]])
    alive = jnp.zeros(1, bool)
    output, state = chance(None, key, jnp.asarray([30]), after._replace(board=full, dead=alive))
    assert bool(state.done[0]) and float(output.discount[0]) == 0.0
    assert float(output.value[0]) == 0.0


def test_value_scale_round_trips_and_two_hot_keeps_the_mean():
    x = jnp.asarray([0.0, 0.4, 3.0, 17.0, 950.0, 12_345.0, 44_000.0])
    np.testing.assert_allclose(inverse_value_transform(value_transform(x)), x, rtol=1e-4, atol=1e-3)
    probabilities = two_hot(x)
    np.testing.assert_allclose(probabilities.sum(-1), 1.0, rtol=1e-6)
    bins = jnp.arange(probabilities.shape[-1])
    np.testing.assert_allclose((probabilities * bins).sum(-1), value_transform(x), rtol=1e-5)
    assert int((probabilities > 0).sum(-1).max()) <= 2
    np.testing.assert_allclose(value_of(jnp.log(probabilities + 1e-30)), x, rtol=1e-3, atol=1e-2)


def reference_expectimax(board, depth):
    """Plain expectimax by its definition, with the original rules: the best legal move's
    merge reward plus the probability-weighted best of what follows; 0 with no legal move."""
    best = 0.0
    legal_values = []
    for move in range(4):
        after, reward = reference_move(board, move)
        if (after == board).all():
            continue
        future, empty = 0.0, np.flatnonzero(after == 0)
        if depth > 1:
            for cell in empty:
                for exponent, p in ((1, 0.9), (2, 0.1)):
                    spawned = after.copy()
                    spawned[cell] = exponent
                    future += p / len(empty) * reference_expectimax(spawned, depth - 1)
        legal_values.append(reward + future)
    return max(legal_values, default=best)


def test_expectimax_player_against_its_definition_on_tiny_boards():
    """Boards with 2 to 4 empty cells, where the definition's recursion is small."""
    rng = np.random.default_rng(3)
    boards = []
    for _ in range(12):
        board = rng.integers(1, 5, 16)
        board[rng.choice(16, rng.integers(2, 5), replace=False)] = 0
        boards.append(board.astype(np.int32))
    for depth in (1, 2):
        values, best = jax.jit(jax.vmap(functools.partial(game2048.expectimax_value, depth=depth)))(
            jnp.asarray(boards)
        )
        for board, got in zip(boards, np.asarray(best), strict=True):
            assert got == pytest.approx(reference_expectimax(board, depth), rel=1e-5)
        legal = jax.vmap(game2048.legal_moves)(jnp.asarray(boards))
        assert np.all(np.isinf(values) == ~np.asarray(legal))


def test_search_over_the_true_model_beats_random_play_with_an_untrained_network():
    """The chance-node wiring: the greedy search of an untrained network whose policy head is
    zeroed, so that its priors are uniform and its values (zero-initialised heads) the same
    everywhere, scores well above a random player over 48 games. The search alone, through
    the rules and the merge rewards, makes the difference; a random policy head's arbitrary
    preferences would decide between near-equal moves instead. With 8 simulations the visit
    counts of the four moves were often tied, and rounding picked the move: 1.3-2.3 times the
    random player's score depending on the processor; with 16, 2.0-2.3 times."""
    config = parse_config(Config, PRESETS, ["--env", "2048"], preset_key=resolve_game)
    network = MLPNet(4, num_blocks=1, num_channels=32)
    variables = network.init(jax.random.PRNGKey(0), jnp.zeros((1, 4, 4, 31)))
    (policy_head,) = [k for k, v in variables["params"].items() if v.get("bias", ()).shape == (4,)]
    variables["params"][policy_head] = jax.tree.map(
        jnp.zeros_like, variables["params"][policy_head]
    )
    hp = hyperparams_of(HyperParams, config)

    def agent(games, key):
        return agent_search(
            variables,
            hp,
            key,
            games,
            env=ENV,
            network=network,
            search="puct",
            num_simulations=16,
            max_num_considered_actions=4,
            greedy=True,
        ).action

    @jax.jit
    def scores():
        def mean_score(player):
            key = jax.random.PRNGKey(4)
            return game2048.play_games(ENV, player, key, num_games=48, max_moves=5_000)[0].mean()

        return mean_score(agent), mean_score(random_player)

    searched, random = map(float, scores())
    assert searched > 1.5 * random, (searched, random)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny 2048 run through the driver, one chunk of 2 iterations: its summary."""
    args = [
        *TINY_AZ,
        "--env", "2048",
        "--num-iterations", "2",
        "--expectimax-depth", "1",
        "--num-channels", "16",
        "--eval-games", "4",
        "--no-progress",
        "--runs-dir", str(tmp_path_factory.mktemp("runs")),
    ]  # fmt: skip
    config = parse_config(Config, PRESETS, args, preset_key=resolve_game)
    return run_training(config, make_train, validate)


def test_a_tiny_2048_run_logs_its_score_and_the_baselines(tiny_run):
    """2048's metrics in metrics.csv and summary.json, the score as the headline."""
    summary = tiny_run
    assert summary["headline_metric"] == "eval_score" and summary["step_unit"] == "moves"
    final = summary["final_metrics_per_seed"][0]
    assert final["eval_score"] == summary["final_mean"] > 0
    for name in ("eval_max_tile", "eval_moves", "eval_reach_512", "eval_random_score"):
        assert np.isfinite(final[name]), name
    assert final["eval_expectimax_score"] > 0 and final["eval_random_score"] > 0
    with open(os.path.join(summary["run_dir"], "metrics.csv")) as f:
        header = f.readline()
    assert "selfplay_score" in header and "selfplay_draw_rate" not in header
    with open(os.path.join(summary["run_dir"], "summary.json")) as f:
        assert json.load(f)["final_mean"] == summary["final_mean"]


def test_play_replays_the_agents_game_and_the_arena_refuses_2048(tiny_run):
    out = io.StringIO()
    board_play.main(purejaxrl_az, ["--play", tiny_run["run_dir"]], io.StringIO(), out)
    text = out.getvalue()
    moves = re.findall(
        r"move (\d+): agent plays (left|up|right|down) \(search visits: .*, score (\d+)", text
    )
    ending = re.search(r"Game over: score (\d+), highest tile (\d+), (\d+) moves\.", text)
    assert ending and len(moves) == int(ending.group(3)) > 10
    assert [int(m[0]) for m in moves] == list(range(1, len(moves) + 1))
    assert moves[-1][2] == ending.group(1) and int(ending.group(2)) >= 16
    final_board = [line.split() for line in text.rstrip().splitlines()[-6:-2]]
    assert [len(row) for row in final_board] == [4] * 4
    assert max(int(cell) for row in final_board for cell in row if cell != ".") == int(
        ending.group(2)
    )
    with pytest.raises(ConfigError, match="2048 is a single-player game"):
        board_play.main(purejaxrl_az, ["--arena", tiny_run["run_dir"], tiny_run["run_dir"]])
