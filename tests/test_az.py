"""AlphaZero: value targets, replay buffer, priors, search legality and symmetries against plain
references (the evaluation's oracle, rollouts and Elo: tests/test_board_eval.py); then whole
runs (reproducibility, devices, bad input). Learning is in tests/test_learning.py."""

import csv
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pgx
import pytest

import purejaxrl_az
from purejaxrl_az import (
    PRESETS,
    SUPPORTED_GAMES,
    Config,
    HyperParams,
    Position,
    ResNet,
    action_permutations,
    agent_search,
    augment_position,
    az_loss,
    board_loss,
    buffer_add,
    buffer_init,
    buffer_sample,
    buffer_update_targets,
    headline_metric,
    make_recurrent_fn,
    make_train,
    masked_logits,
    resolve_game,
    run_search,
    sgd_step,
    validate,
    value_targets,
)
from tests.helpers import (
    TINY_AZ,
    assert_devices_share_all_but,
    assert_identical_runs,
    checkpoint_leaves,
    checkpoint_state,
    metric_table,
    run_script,
)
from utils import board_play
from utils.cli import parse_config
from utils.devices import DEVICE_AXIS
from utils.driver import run_training
from utils.errors import ConfigError
from utils.trainer import Runtime, hyperparams_of


def reference_value_targets(reward, terminated, truncated, value, written, lam, outcome, discount):
    """The targets written as the definition reads, one game and one position at a time;
    `discount` is -1 between two players' plies, gamma between one player's moves."""
    steps, games = reward.shape
    targets = np.zeros((steps, games))
    known = np.zeros((steps, games), bool)
    for g in range(games):
        for t in range(steps):
            if not written[t]:
                continue
            # Walk forward to the end of this game or of the data.
            factor, total, s = 1.0, 0.0, t
            if outcome:
                while True:
                    total += factor * reward[s, g]
                    if terminated[s, g]:
                        targets[t, g], known[t, g] = total, True
                        break
                    if truncated[s, g]:
                        total += factor * (value[s, g] - reward[s, g])
                        targets[t, g], known[t, g] = total, True
                        break
                    if s + 1 >= steps or not written[s + 1]:
                        break  # the game is still running: no target yet
                    factor, s = factor * discount, s + 1
            else:
                targets[t, g], known[t, g] = lambda_return(
                    reward[:, g],
                    terminated[:, g],
                    truncated[:, g],
                    value[:, g],
                    written,
                    lam,
                    t,
                    discount,
                )
    return targets, known


def lambda_return(reward, terminated, truncated, value, written, lam, t, discount):
    """G_t by its recursive definition (a truncated game's last position is worth its value)."""
    if terminated[t]:
        return reward[t], True
    if truncated[t]:
        return value[t], True
    if t + 1 >= len(reward) or not written[t + 1]:
        return 0.0, False
    following, following_known = lambda_return(
        reward, terminated, truncated, value, written, lam, t + 1, discount
    )
    bootstrap = following if following_known else value[t + 1]
    return reward[t] + discount * ((1 - lam) * value[t + 1] + lam * bootstrap), True


def random_trajectories(rng, steps=12, games=5, filled=10, every_move_rewarded=False):
    """Two-player games rewarded at their end; with `every_move_rewarded`, 2048-like games
    whose every move scores."""
    end = rng.random((steps, games)) < 0.25
    truncated = end & (rng.random((steps, games)) < 0.3)
    terminated = end & ~truncated
    reward = np.where(terminated, rng.choice([-1.0, 0.0, 1.0], (steps, games)), 0.0)
    if every_move_rewarded:
        reward = rng.choice([0.0, 4.0, 8.0, 16.0], (steps, games))
    value = rng.uniform(-1, 1, (steps, games))
    written = np.arange(steps) < filled
    return reward, terminated, truncated, value, written


@pytest.mark.parametrize("discount", [-1.0, 0.9])
@pytest.mark.parametrize("outcome,lam", [(True, 1.0), (False, 0.0), (False, 0.7), (False, 1.0)])
def test_value_targets_match_reference_loop(outcome, lam, discount):
    rng = np.random.default_rng(0)
    for _ in range(5):
        reward, terminated, truncated, value, written = random_trajectories(
            rng, every_move_rewarded=discount > 0
        )
        got, got_known = value_targets(
            jnp.asarray(reward, jnp.float32),
            jnp.asarray(terminated),
            jnp.asarray(truncated),
            jnp.asarray(value, jnp.float32),
            jnp.asarray(written),
            jnp.float32(lam),
            jnp.float32(discount),
            outcome,
        )
        want, want_known = reference_value_targets(
            reward, terminated, truncated, value, written, lam, outcome, discount
        )
        np.testing.assert_array_equal(np.asarray(got_known), want_known)
        np.testing.assert_allclose(np.asarray(got)[want_known], want[want_known], atol=1e-5)


def test_outcome_targets_flip_sign_every_ply_and_stop_at_the_game_end():
    # One column: a 3-move game the last mover wins, then a new game still running.
    reward = jnp.array([[0.0], [0.0], [1.0], [0.0], [0.0]])
    terminated = jnp.array([[False], [False], [True], [False], [False]])
    targets, known = value_targets(
        reward,
        terminated,
        jnp.zeros_like(terminated),
        jnp.zeros((5, 1)),
        jnp.ones(5, bool),
        jnp.float32(1.0),
        jnp.float32(-1.0),
        True,
    )
    np.testing.assert_array_equal(np.asarray(targets[:3, 0]), [1.0, -1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(known[:, 0]), [True, True, True, False, False])


def moves(rewards, terminated):
    """Position leaves [steps, games] for one column of scalar moves."""
    steps = len(rewards)
    zeros = jnp.zeros((steps, 1))
    return Position(
        obs=jnp.zeros((steps, 1, 1, 1, 1)),
        legal=jnp.ones((steps, 1, 2), bool),
        action=jnp.zeros((steps, 1), jnp.int32),
        policy=jnp.full((steps, 1, 2), 0.5),
        reward=jnp.asarray(rewards, jnp.float32)[:, None],
        terminated=jnp.asarray(terminated)[:, None],
        truncated=jnp.zeros((steps, 1), bool),
        search_value=zeros[:, 0][:, None],
    )


def test_games_carried_over_get_targets_when_they_end_in_a_later_window():
    example = jax.tree.map(lambda x: x[0], moves([0.0], [False]))
    buffer = buffer_init(example, rows=6)
    buffer = buffer_add(buffer, moves([0.0, 0.0], [False, False]))
    buffer = buffer_update_targets(buffer, jnp.float32(1.0), -1.0, True)
    assert not bool(buffer.known.any())  # the game is still running
    buffer = buffer_add(buffer, moves([0.0, -1.0], [False, True]))  # the 4th move loses
    buffer = buffer_update_targets(buffer, jnp.float32(1.0), -1.0, True)
    np.testing.assert_array_equal(np.asarray(buffer.known[:4, 0]), [True] * 4)
    np.testing.assert_array_equal(np.asarray(buffer.targets[:4, 0]), [1.0, -1.0, 1.0, -1.0])
    # Wrap around: 4 more moves overwrite the 2 oldest rows, and time order still holds.
    buffer = buffer_add(buffer, moves([0.0, 0.0, 0.0, 1.0], [False, False, False, True]))
    buffer = buffer_update_targets(buffer, jnp.float32(1.0), -1.0, True)
    assert int(buffer.size) == 6 and int(buffer.next_row) == 2
    np.testing.assert_array_equal(
        np.asarray(buffer.targets[:, 0]), [-1.0, 1.0, 1.0, -1.0, -1.0, 1.0]
    )
    assert bool(buffer.known.all())


def test_buffer_samples_only_positions_with_a_target():
    example = jax.tree.map(lambda x: x[0], moves([0.0], [False]))
    buffer = buffer_init(example, rows=4)
    buffer = buffer_add(buffer, moves([1.0, 0.0, 0.0], [True, False, False]))
    buffer = buffer_update_targets(buffer, jnp.float32(1.0), -1.0, True)
    batch, targets, weights = buffer_sample(buffer, jax.random.PRNGKey(0), 64)
    np.testing.assert_array_equal(np.asarray(batch.reward), 1.0)  # only row 0 is known
    np.testing.assert_array_equal(np.asarray(targets), 1.0)
    np.testing.assert_array_equal(np.asarray(weights), 1.0)
    empty = buffer_init(example, rows=4)
    _, _, weights = buffer_sample(empty, jax.random.PRNGKey(0), 8)
    np.testing.assert_array_equal(np.asarray(weights), 0.0)


def random_positions(game, num, seed=0, max_moves=6):
    """`num` positions of `game` reached by up to max_moves random legal moves."""
    env = pgx.make(game)
    step = jax.jit(jax.vmap(env.step))
    state = jax.vmap(env.init)(jax.random.split(jax.random.PRNGKey(seed), num))
    key = jax.random.PRNGKey(seed + 1)
    for moves_made in range(max_moves):
        key, k = jax.random.split(key)
        action = jax.random.categorical(k, jnp.where(state.legal_action_mask, 0.0, -jnp.inf))
        after = step(state, action)
        keep = (after.terminated | after.truncated) | (jnp.arange(num) % max_moves <= moves_made)
        state = jax.tree.map(
            lambda old, new, keep=keep: jnp.where(
                keep.reshape(-1, *[1] * (old.ndim - 1)), old, new
            ),
            state,
            after,
        )
    return env, state


def test_priors_are_masked_and_normalised_exactly_once():
    env, state = random_positions("connect_four", 16)
    logits = jax.random.normal(jax.random.PRNGKey(3), (16, env.num_actions))
    legal = state.legal_action_mask.at[:, 0].set(False)  # some moves forbidden everywhere
    state = state.replace(legal_action_mask=legal)

    def evaluate(params, key, s):
        return jnp.zeros((16, env.num_actions)), jnp.zeros(16)

    output = run_search(
        "gumbel", None, jax.random.PRNGKey(0), state, logits, jnp.zeros(16),
        make_recurrent_fn(env, evaluate), num_simulations=4, max_num_considered_actions=16,
        gumbel_scale=1.0, temperature=1.0, dirichlet_alpha=0.3, dirichlet_fraction=0.25,
    )  # fmt: skip
    root_prior = jax.nn.softmax(output.search_tree.children_prior_logits[:, 0])
    masked = np.where(legal, np.exp(logits), 0.0)
    np.testing.assert_allclose(np.asarray(root_prior), masked / masked.sum(-1, keepdims=True), 1e-5)
    np.testing.assert_array_equal(np.asarray(root_prior)[~np.asarray(legal)], 0.0)
    np.testing.assert_allclose(np.asarray(masked_logits(logits, legal)).max(-1), 0.0, atol=1e-6)


@pytest.mark.parametrize("search,game", [("gumbel", "othello"), ("puct", "tic_tac_toe")])
def test_search_never_selects_illegal_moves(search, game):
    env, state = random_positions(game, 64, max_moves=8)
    # Priors that prefer illegal moves as strongly as possible.
    logits = jnp.where(state.legal_action_mask, -5.0, 5.0)

    def evaluate(params, key, s):
        return jnp.where(s.legal_action_mask, -5.0, 5.0), jnp.zeros(64)

    for seed in range(3):
        output = run_search(
            search, None, jax.random.PRNGKey(seed), state, logits, jnp.zeros(64),
            make_recurrent_fn(env, evaluate), num_simulations=16, max_num_considered_actions=16,
            gumbel_scale=1.0, temperature=1.0, dirichlet_alpha=0.3, dirichlet_fraction=0.25,
        )  # fmt: skip
        playable = ~(state.terminated | state.truncated)
        chosen_legal = state.legal_action_mask[jnp.arange(64), output.action]
        assert bool(jnp.all(chosen_legal | ~playable))
        weights = np.asarray(output.action_weights)[np.asarray(playable)]
        assert np.all(weights[~np.asarray(state.legal_action_mask)[np.asarray(playable)]] == 0)


def test_recurrent_fn_values_finished_games_at_zero_with_zero_discount():
    env = pgx.make("tic_tac_toe")
    state = jax.vmap(env.init)(jax.random.split(jax.random.PRNGKey(0), 1))
    for action in (0, 3, 1, 4):  # the first player then wins with cell 2
        state = jax.vmap(env.step)(state, jnp.array([action]))

    def evaluate(params, key, s):
        return jnp.zeros((1, 9)), jnp.full(1, 0.7)  # a value the search must ignore

    recurrent_fn = make_recurrent_fn(env, evaluate)
    output, won = recurrent_fn(None, None, jnp.array([2]), state)
    assert float(output.reward[0]) == 1.0  # the mover's reward
    assert float(output.discount[0]) == 0.0 and float(output.value[0]) == 0.0
    output, _ = recurrent_fn(None, None, jnp.array([5]), won)  # past the end of the game
    assert float(output.reward[0]) == 0.0
    assert float(output.discount[0]) == 0.0 and float(output.value[0]) == 0.0
    output, _ = recurrent_fn(None, None, jnp.array([8]), state)  # a game that goes on
    assert float(output.discount[0]) == -1.0 and float(output.value[0]) == pytest.approx(0.7)


@pytest.mark.parametrize("game", ["tic_tac_toe", "connect_four", "othello", "go_9x9", "hex"])
def test_symmetries_map_observations_legal_masks_and_policies_consistently(game):
    """Playing the mapped moves from a symmetric start reaches the mapped position: its
    observation is the transformed one and its legal mask is the permuted one."""
    env = pgx.make(game)
    perms = action_permutations(game, env.num_actions)
    assert len(perms) > 1
    step = jax.jit(env.step)
    start = env.init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    checked = 0
    for k in range(len(perms)):
        inverse = np.argsort(perms[k])  # old action a is new action inverse[a]
        policy = jnp.asarray(rng.random(env.num_actions), jnp.float32)
        obs, _, _, _ = augment_position(
            game, perms, k, start.observation, start.legal_action_mask, policy, jnp.int32(0)
        )
        if not bool(jnp.all(obs == start.observation)):
            continue  # othello's start is not symmetric under every transform
        checked += 1
        state, mapped = start, start
        for _ in range(6):
            legal = np.flatnonzero(np.asarray(state.legal_action_mask))
            action = int(rng.choice(legal))
            state = step(state, jnp.int32(action))
            mapped = step(mapped, jnp.int32(inverse[action]))
            if bool(state.terminated | state.truncated):
                break
            obs, legal_mask, new_policy, new_action = augment_position(
                game, perms, k, state.observation, state.legal_action_mask, policy, action
            )
            assert int(new_action) == inverse[action]
            np.testing.assert_array_equal(np.asarray(obs), np.asarray(mapped.observation))
            np.testing.assert_array_equal(
                np.asarray(legal_mask), np.asarray(mapped.legal_action_mask)
            )
            np.testing.assert_array_equal(np.asarray(new_policy)[inverse], np.asarray(policy))
    assert checked >= 2


def test_games_without_symmetries_augment_to_themselves():
    assert action_permutations("animal_shogi", 132).shape == (1, 132)


def test_building_the_trainer_compiles_nothing():
    """make_train only plans: an eager jnp call or pgx's env.num_actions (which runs env.init)
    would compile an XLA program before the first chunk can begin tracing. The caches are
    cleared first, so that programs compiled by earlier tests cannot hide one."""
    compiles = []

    def on_event(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(seconds)

    config = parse_config(Config, PRESETS, ["--env", "tic_tac_toe"], preset_key=resolve_game)
    pgx.make("tic_tac_toe")  # pgx's game module, imported at its first make, builds arrays
    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        make_train(config)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == []


@pytest.mark.parametrize(
    "game,cores,backend,num_runs,search,learner",
    [
        # tic_tac_toe's search: dense unless the CPU has one core per device
        ("tic_tac_toe", 1, "cpu", 1, "xla", "dense"),
        ("tic_tac_toe", 1, "cpu", 2, "matmul", "dense"),
        ("tic_tac_toe", 2, "cpu", 1, "dense", "dense"),
        ("tic_tac_toe", 2, "cpu", 2, "dense", "dense"),
        ("tic_tac_toe", 1, "gpu", 1, "dense", "dense"),
        ("connect_four", 2, "cpu", 1, "xla", "xla"),
        ("connect_four", 1, "cpu", 2, "matmul", "matmul"),
        ("connect_four", 1, "tpu", 1, "xla", "matmul"),
    ],
)
def test_convolution_forms_follow_the_runs_and_the_cores_per_device(
    monkeypatch, game, cores, backend, num_runs, search, learner
):
    """make_train picks each network's Conv3x3 form from the runtime and the host's cores per
    XLA device (this process has one device)."""
    built = []
    make_networks = purejaxrl_az.make_networks

    def recording(*args, **kwargs):
        built.append(make_networks(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(purejaxrl_az, "make_networks", recording)
    monkeypatch.setattr(purejaxrl_az, "available_cores", lambda: cores)
    config = parse_config(Config, PRESETS, ["--env", game], preset_key=resolve_game)
    make_train(config, Runtime(num_runs=num_runs, backend=backend))
    ((network, learner_network),) = built
    assert (network.conv_method, learner_network.conv_method) == (search, learner)


def test_loss_ignores_illegal_moves_and_masked_samples():
    logits = jnp.array([[2.0, 0.0, 50.0], [0.0, 0.0, 0.0]])
    legal = jnp.array([[True, True, False], [True, True, True]])
    target = jnp.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    policy_loss, value_loss = az_loss(
        logits, jnp.array([0.5, 0.0]), legal, target, jnp.array([1.0, 9.0]), jnp.array([1.0, 0.0])
    )
    log_p = np.log(np.exp([2.0, 0.0]) / np.exp([2.0, 0.0]).sum())
    assert float(policy_loss) == pytest.approx(-(0.5 * log_p).sum(), rel=1e-5)
    assert float(value_loss) == pytest.approx(0.25)


def random_buffer(seed, rows=8, games=4):
    """A buffer of random tic_tac_toe positions (`rows` moves of each of `games` games), every
    game over at its last move, so every position has a value target."""
    rng = np.random.default_rng(seed)
    legal = rng.random((rows, games, 9)) < 0.7
    legal[..., 0] = True
    policy = rng.random((rows, games, 9)) * legal
    ended = np.broadcast_to(np.arange(rows)[:, None] == rows - 1, (rows, games))
    data = Position(
        obs=rng.random((rows, games, 3, 3, 2)) < 0.3,
        legal=legal,
        action=np.zeros((rows, games), np.int32),
        policy=(policy / policy.sum(-1, keepdims=True)).astype(np.float32),
        reward=(ended * rng.choice([-1.0, 1.0], games)).astype(np.float32),
        terminated=ended,
        truncated=np.zeros((rows, games), bool),
        search_value=np.zeros((rows, games), np.float32),
    )

    @jax.jit
    def fill(data):
        buffer = buffer_add(buffer_init(jax.tree.map(lambda x: x[0], data), rows), data)
        return buffer_update_targets(buffer, jnp.float32(1.0), -1.0, True)

    return fill(data)


def test_sgd_step_averages_gradients_and_batch_statistics_over_devices():
    """The first SGD step on two devices, each with its own buffer, against each device's step
    alone. The devices are a vmapped axis named DEVICE_AXIS, whose collectives are pmap's.
    Adam's update hardly changes if the gradient doubles, but its first moment after one step
    is 0.1 x the gradient: a sum over devices instead of the mean would double it."""
    learner = ResNet(9, num_blocks=1, num_channels=8, batch_norm=True, conv_method="dense")
    hp = hyperparams_of(HyperParams, Config())

    @functools.partial(jax.jit, static_argnums=0)
    def fresh_network(num_devices):
        """The same new network, BatchNorm statistics and optimiser on every device."""
        variables = learner.init(jax.random.PRNGKey(0), jnp.zeros((1, 3, 3, 2)), train=True)
        start = (variables["params"], variables["batch_stats"])
        start = (*start, optax.adam(hp.learning_rate).init(variables["params"]))
        return jax.tree.map(lambda x: jnp.stack([x] * num_devices), start)

    step = functools.partial(
        sgd_step,
        learner=learner,
        loss_fn=board_loss,
        game="tic_tac_toe",
        perms=action_permutations("tic_tac_toe", 9),
        batch_size=16,
    )
    run = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, 0, None, 0), axis_name=DEVICE_AXIS))
    buffers = [random_buffer(seed) for seed in (1, 2)]
    keys = jax.random.split(jax.random.PRNGKey(3), 2)

    def on_devices(buffers, keys):
        stacked = jax.tree.map(lambda *x: np.stack(x), *buffers)
        return jax.device_get(run(*fresh_network(len(buffers)), stacked, hp, keys))

    both = on_devices(buffers, keys)
    alone = [on_devices([buffer], key[None]) for buffer, key in zip(buffers, keys, strict=True)]
    for name, part in (
        ("Adam's first moment", lambda out: out.opt_state[0].mu),
        ("BatchNorm statistics", lambda out: out.batch_stats),
    ):
        mean_alone = jax.tree.map(lambda a, b: (a[0] + b[0]) / 2, *(part(out) for out in alone))
        for got, want in zip(jax.tree.leaves(part(both)), jax.tree.leaves(mean_alone), strict=True):
            for device in (0, 1):
                np.testing.assert_allclose(got[device], want, rtol=1e-5, atol=1e-9, err_msg=name)
    for leaf in jax.tree.leaves(both.params):
        np.testing.assert_array_equal(leaf[0], leaf[1])


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------


def tiny_args(runs_dir, game="tic_tac_toe"):
    """4 iterations in 2 chunks with an evaluation after each: compiles in well under a minute."""
    return [
        "purejaxrl_az.py",
        *TINY_AZ,
        "--env",
        game,
        "--no-progress",
        "--runs-dir",
        str(runs_dir),
    ]


def train(args):
    config = parse_config(Config, PRESETS, args, preset_key=resolve_game)
    return run_training(config, make_train, validate)


def run_dir_of(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1].split("-> ")[-1]


# A run that a Ctrl-C stops after its second iteration: the driver's progress report, which
# follows every compiled chunk, raises KeyboardInterrupt there.
INTERRUPTED_AFTER_ITERATION_2 = """
import runpy, sys
from utils import driver

def interrupt(self, done, *_):
    if done == 2:
        raise KeyboardInterrupt

driver._Progress.update = interrupt
sys.argv = ["purejaxrl_az.py", *sys.argv[1:]]
runpy.run_path("purejaxrl_az.py", run_name="__main__")
"""


def test_run_outputs_reproducibility_resume_and_two_devices(tmp_path):
    """Two seeds x a sweep of two learning rates on two devices (--cpu-devices 2 restarts the
    process with the host split in two), vmapped through self-play, SGD and the in-loop
    evaluation, with --record-games; the same command again, interrupted after its
    first chunk and resumed, gives the same numbers. Its 3 iterations make chunks of 2 and 1:
    the last runs the first's program, and its evaluation lands on iteration 3."""
    flags = ["--num-seeds", "2", "--cpu-devices", "2", "--record-games", "--num-iterations", "3"]
    flags += ["--sweep", "lr=1e-3,3e-3"]
    first = run_dir_of(run_script(*tiny_args(tmp_path / "a"), *flags))
    stopped = run_script(
        "-c", INTERRUPTED_AFTER_ITERATION_2, *tiny_args(tmp_path / "b")[1:], *flags, devices=2
    )
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    second = stopped.stderr.strip().split("--resume ")[-1]
    assert not os.path.exists(f"{second}/summary.json")
    resumed = run_script("purejaxrl_az.py", "--resume", second, "--no-progress", devices=2)
    assert run_dir_of(resumed) == second
    assert_identical_runs(first, second)
    with open(f"{second}/summary.json") as f:
        assert json.load(f)["resumed_from_update"] == 2
    with open(f"{first}/summary.json") as f:
        summary = json.load(f)
    assert summary["algo"] == "az" and summary["step_unit"] == "moves"
    assert summary["headline_metric"] == "eval_oracle_score"  # tic_tac_toe's strongest
    assert summary["num_devices"] == 2
    ranking = summary["sweep"]["ranking"]
    assert sorted(r["hyperparams"]["learning_rate"] for r in ranking) == [1e-3, 3e-3]
    finals = summary["final_metrics_per_seed"]
    assert len(finals) == 4 and finals[0] != finals[1]  # seeds differ
    # Evaluated again with its own --eval-games, the final state plays the last chunk's games.
    again = run_script("purejaxrl_az.py", "--resume", first, "--eval-games", "8", devices=2)
    assert again.returncode == 0, again.stderr[-3000:]
    with open(f"{first}/summary.json") as f:
        replayed = json.load(f)["eval_metrics_per_seed"]
    for final, evaluation in zip(finals, replayed, strict=True):
        assert evaluation == {k: v for k, v in final.items() if k.startswith("eval_")}
    for final in finals:
        assert final["eval_random_win"] + final["eval_random_draw"] + final[
            "eval_random_loss"
        ] == pytest.approx(1.0)
        assert 0.0 <= final["eval_optimal_move_rate"] <= 1.0
    with open(f"{first}/metrics.csv") as f:
        header = f.readline().strip().split(",")
    assert {"eval_oracle_elo_low", "selfplay_game_length", "value_loss"} <= set(header)
    # Network, BatchNorm statistics, optimiser and counters are shared by both devices; their
    # games, replay data and keys are not.
    per_device = (
        ".buffer.data",
        ".buffer.targets",
        ".buffer.known",
        ".games",
        ".game_length",
    )
    assert_devices_share_all_but(checkpoint_state(purejaxrl_az, first), (*per_device, ".key"))
    assert_game_records(first, evaluations=(2, 3))


# The biases of the layers whose outputs a BatchNorm normalises (the 3x3 convolutions and the
# heads' first 1x1 convolutions): the normalisation subtracts them again, so their gradient is
# zero and what SGD gets for it is rounding noise, which Adam turns into steps of up to the
# learning rate. Rounded differently, they drift apart by that much, and so do the running
# means of the activations they shift.
DRIFTING_LEAVES = re.compile(
    r"\.params\['(Conv3x3_\d+|Dense_0|Dense_2)'\]\['bias'\]|\.batch_stats\[.*\]\['mean'\]"
)


def test_seed_and_sweep_configuration_equal_single_runs(tmp_path):
    """Run (configuration k, seed index i) of --num-seeds 2 x --sweep lr=1e-3,3e-3 is the run
    with that learning rate and seed 1 + i: bit for bit in another batched run, with the seeds
    shifted and the sweep reordered. A single run is unbatched, and XLA rounds its float32
    arithmetic differently (by ~1e-7): over these two iterations without evaluation its moves
    and targets stay the same, its metrics and network agree to 1e-4 (the drifting biases to
    the learning rate per SGD step). A wrong key or a swapped learning rate is off by 1e-2 and
    more."""
    flags = [*tiny_args(tmp_path)[1:], "--num-iterations", "2", "--eval-games", "0"]
    together = train([*flags, "--num-seeds", "2", "--sweep", "lr=1e-3,3e-3"])["run_dir"]
    reordered = ["--seed", "2", "--num-seeds", "2", "--sweep", "lr=3e-3,1e-3"]
    shifted = train([*flags, *reordered])["run_dir"]
    a, b = checkpoint_leaves(together), checkpoint_leaves(shifted)
    # (learning rate 3e-3, seed 2) is run 3 of one and run 0 of the other; (1e-3, seed 2): 1, 2
    for run, same_run in ((3, 0), (1, 2)):
        np.testing.assert_array_equal(
            metric_table(together, run % 2, run // 2),
            metric_table(shifted, same_run % 2, same_run // 2),
        )
        for name in a:  # every leaf is [devices, runs, ...]
            np.testing.assert_array_equal(a[name][:, run], b[name][:, same_run], err_msg=name)

    alone = train([*flags, "--seed", "2", "--learning-rate", "3e-3"])["run_dir"]
    np.testing.assert_allclose(
        metric_table(together, 1, 1), metric_table(alone, 0), rtol=1e-4, atol=1e-6
    )
    sgd_steps = 2 * 2  # iterations x --updates-per-iteration
    batched = jax.tree_util.tree_flatten_with_path(checkpoint_state(purejaxrl_az, together))[0]
    single = jax.tree.leaves(checkpoint_state(purejaxrl_az, alone))
    for (path, x), y in zip(batched, single, strict=True):
        name = jax.tree_util.keystr(path)
        x, y = x[:, 3], y[:, 0]
        if DRIFTING_LEAVES.fullmatch(name):
            np.testing.assert_allclose(x, y, rtol=0, atol=sgd_steps * 3e-3, err_msg=name)
        elif np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6, err_msg=name)
        else:  # games, moves, counters and keys
            np.testing.assert_array_equal(x, y, err_msg=name)


def assert_game_records(run_dir, evaluations):
    """--record-games: one SVG animation per opponent and seat at each evaluation, and the
    evaluation's metrics in metrics.csv at those iterations only."""
    names = sorted(os.listdir(os.path.join(run_dir, "games")))
    assert names == [
        f"iteration{update:06d}_{opponent}_agent_{seat}.svg"
        for update in evaluations
        for opponent in ("oracle", "random")
        for seat in ("first", "second")
    ]
    for name in names:
        with open(os.path.join(run_dir, "games", name)) as f:
            svg = f.read()
        assert "<svg" in svg and "@keyframes" in svg  # a CSS animation of the moves
    with open(os.path.join(run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert not any(name.startswith("record_") for name in rows[0])
    for row in rows:  # one row per run and iteration
        assert (row["eval_oracle_score"] != "nan") == (int(row["update"]) in evaluations), row


@pytest.mark.parametrize(
    "flags,headline",
    [
        (["--env", "tic_tac_toe"], "eval_oracle_score"),
        (["--env", "tic_tac_toe", "--eval-opponents", "random", "mcts"], "eval_mcts_score"),
        (["--env", "connect_four"], "eval_mcts_score"),
        (["--env", "connect_four", "--eval-opponents", "random"], "eval_random_score"),
        (["--env", "connect_four", "--eval-games", "0"], "value_loss"),
        (["--env", "2048"], "eval_score"),
    ],
)
def test_the_headline_is_the_score_against_the_strongest_opponent(flags, headline):
    config = parse_config(Config, PRESETS, flags, preset_key=resolve_game)
    validate(config, Runtime())
    assert headline_metric(config, solo=flags[1] == "2048") == headline


def test_presets_help_and_game_names():
    assert set(PRESETS) <= set(SUPPORTED_GAMES)
    assert resolve_game("Connect-Four") == "connect_four"
    config = parse_config(Config, PRESETS, ["--env", "connect_four"], preset_key=resolve_game)
    assert config.num_games == 128 and config.eval_every == 10
    assert (config.num_simulations, config.eval_simulations) == (16, 32)
    assert resolve_game("2048") == "2048"
    for game, reason in [
        ("backgammon", "dice"),
        ("kuhn_poker", "hidden-information"),
        ("minatar-breakout", "purejaxrl_ppo.py"),
    ]:
        with pytest.raises(ConfigError, match=rf"{game}.*{reason}.*valid games: tic_tac_toe"):
            resolve_game(game)
    with pytest.raises(ConfigError, match=r"unknown game 'chekers'.*connect_four"):
        resolve_game("chekers")


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--eval-games", "7"], "--eval-games 7 must split evenly"),
        (["--buffer-size", "32"], "--buffer-size 32 keeps only 2 moves"),
        (["--updates-per-chunk", "3"], "set --eval-every instead"),
        (["--td-lambda", "1.5"], r"--td-lambda must be a finite number in \[0, 1\]"),
        (["--gumbel-scale", "nan"], "--gumbel-scale must be a finite number"),
        (["--num-simulations", "0"], "--num-simulations must be >= 1"),
        (["--gamma", "0.99"], "two-player games alternate sides"),
        (["--env", "2048", "--search", "gumbel"], "no Gumbel search with chance nodes"),
        (["--env", "2048", "--batch-norm"], "LayerNorm"),
        (["--env", "2048", "--record-games"], "--play RUN_DIR"),
        (["--env", "2048", "--gamma", "0"], r"--gamma must be a finite number in \(0, 1\]"),
        (["--env", "2048", "--expectimax-depth", "4"], "--expectimax-depth"),
        (["--eval-opponents", "random", "minimax"], "name each of random, mcts, oracle"),
        (["--eval-opponents", "mcts", "mcts"], "at most once"),
        (["--env", "connect_four", "--eval-opponents", "oracle"], "tic_tac_toe only"),
    ],
)
def test_bad_flags_raise_config_error(tmp_path, flags, match):
    args = tiny_args(tmp_path)[1:] + flags
    config = parse_config(Config, PRESETS, args, preset_key=resolve_game)
    with pytest.raises(ConfigError, match=match):
        validate(config, Runtime())


def test_bad_swept_values_are_refused_before_anything_is_written(tmp_path):
    args = [*tiny_args(tmp_path / "runs")[1:], "--sweep", "lr=1e-3,inf"]
    config = parse_config(Config, PRESETS, args, preset_key=resolve_game)
    with pytest.raises(ConfigError, match="--learning-rate must be a finite number"):
        run_training(config, make_train, validate)
    assert not (tmp_path / "runs").exists()


def test_bad_game_exits_2_before_compiling(tmp_path):
    result = run_script("purejaxrl_az.py", "--env", "backgammon", "--runs-dir", str(tmp_path))
    assert result.returncode == 2
    assert "dice" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path).exists() or not any(tmp_path.iterdir())


def test_eval_games_0_means_no_evaluation(tmp_path):
    """Traced, not compiled: the chunk's outputs hold no evaluation metric, and the headline
    is self-play's value loss."""
    args = [*tiny_args(tmp_path)[1:], "--eval-games", "0"]
    config = parse_config(Config, PRESETS, args, preset_key=resolve_game)
    validate(config, Runtime())
    trainer = make_train(config)
    assert trainer.headline_metric == "value_loss"

    def chunk(key):
        return trainer.train_chunk(trainer.init(key, trainer.hyperparams), 2)[1]

    metrics = jax.eval_shape(jax.vmap(chunk, axis_name=DEVICE_AXIS), jax.random.PRNGKey(0)[None])
    assert "value_loss" in metrics and not any(name.startswith("eval_") for name in metrics)
    assert trainer.chunk_evaluation is None  # --resume --eval-games 0 has nothing to evaluate


@pytest.mark.parametrize("eval_simulations,searched", [(0, 4), (6, 6)])
def test_the_evaluation_searches_with_eval_simulations(
    tmp_path, monkeypatch, eval_simulations, searched
):
    """Traced, not compiled: self-play searches with --num-simulations and the evaluation's
    agent with --eval-simulations (0: the same as self-play); --play and --arena default to
    the evaluation's."""
    calls = []

    def recording_search(*args, num_simulations, greedy, **kwargs):
        calls.append((greedy, num_simulations))
        return agent_search(*args, num_simulations=num_simulations, greedy=greedy, **kwargs)

    monkeypatch.setattr(purejaxrl_az, "agent_search", recording_search)
    args = [*tiny_args(tmp_path)[1:], "--num-simulations", "4"]
    args += ["--eval-simulations", str(eval_simulations)]
    config = parse_config(Config, PRESETS, args, preset_key=resolve_game)
    validate(config, Runtime())
    trainer = make_train(config)

    def chunk_and_evaluation(key):
        state, _ = trainer.train_chunk(trainer.init(key, trainer.hyperparams), 1)
        return trainer.chunk_evaluation(state)

    jax.eval_shape(
        jax.vmap(chunk_and_evaluation, axis_name=DEVICE_AXIS), jax.random.PRNGKey(0)[None]
    )
    assert sorted(set(calls)) == [(False, 4), (True, searched)]
    assert board_play.simulations(purejaxrl_az, config, None) == searched
    assert board_play.simulations(purejaxrl_az, config, 9) == 9


def test_the_in_loop_evaluation_runs_alone_to_evaluate_a_finished_run_again(tmp_path):
    """Traced, not compiled: `chunk_evaluation` of a state gives the eval_* metrics that end
    every chunk, one value each, which --resume of a finished run with --eval-games computes
    again."""
    config = parse_config(Config, PRESETS, tiny_args(tmp_path)[1:], preset_key=resolve_game)
    trainer = make_train(config)

    def evaluation(key):
        return trainer.chunk_evaluation(trainer.init(key, trainer.hyperparams))

    metrics = jax.eval_shape(
        jax.vmap(evaluation, axis_name=DEVICE_AXIS), jax.random.PRNGKey(0)[None]
    )
    # tic_tac_toe's preset plays random and the perfect player, and judges every agent move
    assert {"eval_oracle_score", "eval_random_elo", "eval_optimal_move_rate"} <= set(metrics)
    assert not any(name.startswith("eval_mcts") for name in metrics)
    assert all(name.startswith("eval_") and v.shape == (1,) for name, v in metrics.items())
