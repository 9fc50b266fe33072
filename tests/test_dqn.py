"""DQN: targets, replay buffer and epsilon schedule against plain NumPy; then whole runs (seeds,
reproducibility, devices, bad input). Learning is in tests/test_learning.py."""

import csv
import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from scipy import stats

import purejaxrl_dqn
from purejaxrl_dqn import (
    PRESETS,
    Config,
    QNetwork,
    Transition,
    buffer_add,
    buffer_init,
    buffer_sample,
    linear_epsilon,
    make_train,
    n_step_return,
    td_targets,
    validate,
)
from tests.helpers import (
    TINY_DQN,
    assert_devices_share_all_but,
    assert_seed_matches_single_run,
    checkpoint_state,
    run_script,
)
from utils.cli import parse_config
from utils.devices import DEVICE_AXIS
from utils.driver import run_training
from utils.errors import ConfigError
from utils.trainer import Runtime


def tiny_args(runs_dir):
    return [*TINY_DQN, "--no-progress", "--runs-dir", str(runs_dir)]


@pytest.fixture
def tiny_dqn_args(tmp_path):
    return tiny_args(tmp_path / "runs")


def train(args):
    return run_training(parse_config(Config, PRESETS, args), make_train, validate)


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------


def td_target_reference(
    rewards, terminated, truncated, next_ids, q_target, q_online, gamma, double
):
    """Textbook n-step targets, one window and one step at a time. `next_ids[b, k]` names the
    observation step k led to (the final one where the episode ended) in the Q tables."""
    batch_size, n = rewards.shape
    targets = np.zeros(batch_size)
    for b in range(batch_size):
        ret, discount = 0.0, 1.0
        for k in range(n):
            ret += discount * rewards[b, k]
            discount *= gamma
            if terminated[b, k] or truncated[b, k]:
                break
        if terminated[b, k]:
            targets[b] = ret
            continue
        next_id = next_ids[b, k]
        action = np.argmax(q_online[next_id] if double else q_target[next_id])
        targets[b] = ret + discount * q_target[next_id, action]
    return targets


def trainer_targets(rewards, terminated, truncated, next_ids, q_target, q_online, gamma, double):
    """The trainer's `td_targets` on the same windows; observations are ids into the Q tables."""
    batch = Transition(
        obs=None,
        action=None,
        reward=rewards.astype(np.float32),
        terminated=terminated.astype(np.float32),
        truncated=truncated.astype(np.float32),
        next_obs=next_ids[..., None].astype(np.float32),
    )
    return td_targets(
        batch,
        lambda obs: q_target[obs[:, 0].astype(int)],
        lambda obs: q_online[obs[:, 0].astype(int)],
        np.float32(gamma),
        double,
    )


@pytest.mark.parametrize("double", [True, False])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_td_targets_match_reference_loop(n, double):
    rng = np.random.default_rng(n)
    batch_size, num_actions = 200, 3
    rewards = rng.normal(size=(batch_size, n)).astype(np.float32)
    terminated = rng.random((batch_size, n)) < 0.15
    truncated = rng.random((batch_size, n)) < 0.15  # some steps are both
    next_ids = rng.permutation(batch_size * n).reshape(batch_size, n)
    q_target = rng.normal(size=(batch_size * n, num_actions)).astype(np.float32)
    q_online = rng.normal(size=(batch_size * n, num_actions)).astype(np.float32)
    assert (truncated & ~terminated).any() and (terminated & truncated).any()
    args = (rewards, terminated, truncated, next_ids, q_target, q_online, 0.97, double)
    np.testing.assert_allclose(
        trainer_targets(*args), td_target_reference(*args), rtol=1e-5, atol=1e-5
    )


def test_truncation_bootstraps_from_final_observation_value():
    """A time limit is not a terminal state: the target keeps gamma^k * V(final observation)."""
    gamma = 0.9
    q = np.array([[10.0, 4.0], [20.0, 2.0], [30.0, 1.0]], np.float32)  # by observation id
    no = np.zeros((1, 1), bool)
    yes = np.ones((1, 1), bool)
    one = np.ones((1, 1), np.float32)
    # 1-step: truncated -> 1 + gamma * 10; the same step terminated -> 1.
    got = trainer_targets(one, no, yes, np.array([[0]]), q, q, gamma, True)
    assert float(got[0]) == pytest.approx(1.0 + gamma * 10.0)
    got = trainer_targets(one, yes, no, np.array([[0]]), q, q, gamma, True)
    assert float(got[0]) == pytest.approx(1.0)
    # 3-step, truncated at the second step: the window stops there and bootstraps from the
    # final observation of that step (id 1), not from the third step (a new episode).
    rewards = np.array([[1.0, 2.0, 4.0]], np.float32)
    truncated = np.array([[False, True, False]])
    none = np.zeros((1, 3), bool)
    got = trainer_targets(rewards, none, truncated, np.array([[0, 1, 2]]), q, q, gamma, True)
    assert float(got[0]) == pytest.approx(1.0 + gamma * 2.0 + gamma**2 * 20.0)
    got = trainer_targets(rewards, truncated, none, np.array([[0, 1, 2]]), q, q, gamma, True)
    assert float(got[0]) == pytest.approx(1.0 + gamma * 2.0)
    # No episode end: all three rewards, then gamma^3 * V(id 2).
    got = trainer_targets(rewards, none, none, np.array([[0, 1, 2]]), q, q, gamma, True)
    assert float(got[0]) == pytest.approx(1.0 + gamma * 2.0 + gamma**2 * 4.0 + gamma**3 * 30.0)


def test_double_dqn_lets_the_online_network_pick_the_action():
    q_target = np.array([[5.0, 2.0]], np.float32)
    q_online = np.array([[0.0, 1.0]], np.float32)  # prefers action 1, which the target values 2
    args = (np.zeros((1, 1), np.float32), np.zeros((1, 1), bool), np.zeros((1, 1), bool))
    double = trainer_targets(*args, np.array([[0]]), q_target, q_online, 1.0, True)
    plain = trainer_targets(*args, np.array([[0]]), q_target, q_online, 1.0, False)
    assert float(double[0]) == 2.0 and float(plain[0]) == 5.0


def test_n_step_return_parts():
    rewards = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], np.float32)
    terminated = np.array([[0, 0, 1], [1, 0, 0]], np.float32)
    returns, discount, last = n_step_return(rewards, terminated, np.zeros_like(terminated), 0.5)
    np.testing.assert_allclose(returns, [1.75, 1.0])
    np.testing.assert_allclose(discount, [0.0, 0.0])
    np.testing.assert_array_equal(last, [2, 0])


# ---------------------------------------------------------------------------------------------
# Replay buffer and exploration
# ---------------------------------------------------------------------------------------------


def numbered_steps(first_step, num_steps, num_envs):
    """Time steps whose reward is the global step number and whose action is the env index."""
    steps = np.arange(first_step, first_step + num_steps, dtype=np.float32)
    reward = np.repeat(steps[:, None], num_envs, axis=1)
    zeros = np.zeros_like(reward)
    action = np.tile(np.arange(num_envs, dtype=np.int32), (num_steps, 1))
    return Transition(reward[..., None], action, reward, zeros, zeros, reward[..., None])


def empty_buffer(capacity, num_envs):
    return buffer_init(jax.tree.map(lambda x: x[0], numbered_steps(0, 1, num_envs)), capacity)


def test_buffer_samples_only_written_rows_before_it_is_full():
    buffer = buffer_add(empty_buffer(capacity=10, num_envs=2), numbered_steps(0, 3, 2))
    assert int(buffer.pos) == 3 and int(buffer.size) == 3
    batch = buffer_sample(buffer, jax.random.PRNGKey(0), 3000, window=1)
    assert set(np.unique(batch.reward).tolist()) == {0.0, 1.0, 2.0}
    assert set(np.unique(batch.action).tolist()) == {0, 1}
    # Windows of 2 start only where the whole window is written: at steps 0 and 1.
    batch = buffer_sample(buffer, jax.random.PRNGKey(1), 3000, window=2)
    assert set(np.unique(batch.reward[:, 0]).tolist()) == {0.0, 1.0}
    np.testing.assert_array_equal(batch.reward[:, 1], batch.reward[:, 0] + 1)


def test_buffer_wraps_around_over_the_oldest_rows():
    buffer = empty_buffer(capacity=10, num_envs=3)
    for first in range(0, 12, 4):  # 12 steps into 10 rows: steps 10 and 11 replace 0 and 1
        buffer = buffer_add(buffer, numbered_steps(first, 4, 3))
    assert int(buffer.pos) == 2 and int(buffer.size) == 10
    np.testing.assert_array_equal(buffer.data.reward[:, 0], [10, 11, 2, 3, 4, 5, 6, 7, 8, 9])
    batch = buffer_sample(buffer, jax.random.PRNGKey(2), 5000, window=3)
    # Windows are consecutive steps of one env, also across the wrap (9, 10, 11).
    np.testing.assert_array_equal(batch.reward[:, 1:], batch.reward[:, :1] + np.arange(1, 3))
    np.testing.assert_array_equal(batch.action, np.repeat(batch.action[:, :1], 3, axis=1))
    assert set(np.unique(batch.reward[:, 0]).tolist()) == set(range(2, 10))


def test_buffer_sampling_is_uniform_over_valid_windows():
    buffer = empty_buffer(capacity=10, num_envs=3)
    for first in range(0, 12, 4):
        buffer = buffer_add(buffer, numbered_steps(first, 4, 3))
    batch = buffer_sample(buffer, jax.random.PRNGKey(3), 24_000, window=3)
    starts = np.asarray(batch.reward[:, 0]).astype(int) - 2  # 8 valid starts: steps 2..9
    cells = starts * 3 + np.asarray(batch.action[:, 0])  # x 3 envs = 24 equally likely windows
    counts = np.bincount(cells, minlength=24)
    assert counts.size == 24
    assert stats.chisquare(counts).pvalue > 1e-3, counts


def test_linear_epsilon_schedule():
    values = [float(linear_epsilon(t, 1.0, 0.05, 1000.0)) for t in (0, 500, 1000, 5000)]
    np.testing.assert_allclose(values, [1.0, 0.525, 0.05, 0.05], rtol=1e-6)
    assert float(linear_epsilon(0, 1.0, 0.05, 0.0)) == pytest.approx(0.05)


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_trainer(tmp_path_factory):
    """The tiny config, an initial state on one device and its compiled 8-update chunk."""
    args = tiny_args(tmp_path_factory.mktemp("runs"))
    config = dataclasses.replace(parse_config(Config, PRESETS, args), num_devices=1)
    trainer = make_train(config)
    state = jax.pmap(lambda key: trainer.init(key, trainer.hyperparams), axis_name=DEVICE_AXIS)(
        jax.random.PRNGKey(0)[None]
    )
    run = jax.pmap(lambda state: trainer.train_chunk(state, 8), axis_name=DEVICE_AXIS)
    return config, state, run.lower(state).compile()


def test_buffer_holds_consecutive_steps_with_the_pre_reset_observation(tiny_trainer):
    config, state, run = tiny_trainer
    state, _ = run(state)
    data = jax.tree.map(lambda x: np.asarray(x[0]), state.buffer.data)
    num_rows = 8 * config.train_frequency  # not wrapped yet
    obs, next_obs = data.obs[:num_rows], data.next_obs[:num_rows]
    ended = (data.terminated[: num_rows - 1] + data.truncated[: num_rows - 1]) > 0
    same = np.all(next_obs[:-1] == obs[1:], axis=-1)
    assert ended.sum() >= 2
    np.testing.assert_array_equal(same, ~ended)  # a new episode starts after every end
    # Where CartPole terminated, next_obs is the fallen pole, not the reset observation.
    fallen = (np.abs(next_obs[:-1, :, 0]) > 2.4) | (np.abs(next_obs[:-1, :, 2]) > 0.2094)
    np.testing.assert_array_equal(fallen[ended], True)


def test_hyperparameters_are_state_not_program(tiny_trainer):
    """One compiled program runs any learning rate or learning start: what a sweep needs."""
    _, state, run = tiny_trainer  # compiled once, before any of these hyperparameters existed
    frozen = state._replace(hparams=state.hparams._replace(learning_rate=np.zeros(1, np.float32)))
    late = state._replace(
        hparams=state.hparams._replace(learning_starts=np.full(1, 10**6, np.int32))
    )
    trained, metrics = run(state)
    # Learning starts at update 8 (128 env steps), where the target network is synced too.
    assert np.isnan(metrics["loss"][0, :7]).all() and np.isfinite(metrics["loss"][0, 7])
    for before, after, target in zip(
        jax.tree.leaves(state.params),
        jax.tree.leaves(trained.params),
        jax.tree.leaves(trained.target_params),
        strict=True,
    ):
        assert not np.array_equal(before, after)
        np.testing.assert_array_equal(after, target)
    for changed in (frozen, late):
        out, _ = run(changed)
        for before, after in zip(
            jax.tree.leaves(state.params), jax.tree.leaves(out.params), strict=True
        ):
            np.testing.assert_array_equal(before, after)


def test_networks_and_minatar_buffer_dtype(tmp_path):
    obs = np.zeros((5, 10, 10, 4), np.float32)
    for image, shape in ((True, obs.shape), (False, (5, 7))):
        for dueling in (False, True):
            network = QNetwork(3, (32,) if image else (32, 16), dueling, image)
            x = np.random.default_rng(0).random(shape).astype(np.float32)
            params = network.init(jax.random.PRNGKey(0), x)
            q, captured = network.apply(params, x, capture_intermediates=True)
            assert q.shape == (5, 3)
            if dueling:  # Q = V + A - mean(A): the mean Q over actions is the value stream
                value = captured["intermediates"][f"Dense_{1 if image else 2}"]["__call__"][0]
                np.testing.assert_allclose(q.mean(-1), value[:, 0], rtol=1e-5, atol=1e-6)
    args = [*tiny_args(tmp_path), "--env", "Breakout", "--dueling"]
    config = dataclasses.replace(parse_config(Config, PRESETS, args), num_devices=1)
    trainer = make_train(config)
    state, metrics = jax.pmap(
        lambda key: trainer.train_chunk(trainer.init(key, trainer.hyperparams), 10),
        axis_name=DEVICE_AXIS,
    )(jax.random.PRNGKey(0)[None])
    assert state.buffer.data.obs.dtype == np.uint8  # MinAtar's 0/1 channels, 4x smaller
    # flattened, [devices, rows, envs, 400] (a TPU pads small trailing dimensions)
    assert state.buffer.data.obs.shape == state.buffer.data.next_obs.shape == (1, 64, 4, 400)
    assert np.isfinite(metrics["loss"][0, -1]) and np.isfinite(metrics["q_mean"][0, -1])


def test_presets_and_help():
    config = parse_config(Config, PRESETS, ["--env", "Breakout"])
    assert config.num_envs == 128 and config.buffer_size == 100_000 and config.loss == "huber"
    config = parse_config(Config, PRESETS, ["--env", "Acrobot", "--n-step", "1"])
    assert config.num_envs == 20 and config.n_step == 1 and config.double_dqn
    result = run_script("purejaxrl_dqn.py", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    flags = "--total-timesteps --learning-rate --num-envs --buffer-size --gamma --tau"
    flags += " --target-network-frequency --batch-size --start-e --end-e --exploration-fraction"
    flags += " --learning-starts --train-frequency --gradient-steps --double-dqn --no-double-dqn"
    flags += " --n-step --loss --dueling --no-dueling --max-grad-norm --hidden-sizes --num-seeds"
    for flag in flags.split():
        assert flag in text, flag


def test_run_outputs_and_seeds_are_independent(tiny_dqn_args):
    # Every action random, so the actions come from the exploration keys alone.
    args = [*tiny_dqn_args, "--num-seeds", "2", "--start-e", "1", "--end-e", "1"]
    summary = train(args)
    run_dir = summary["run_dir"]
    assert os.path.basename(run_dir).startswith("CartPole-v1__dqn__1__")
    assert summary["num_updates"] == 32 and summary["env_steps_per_seed"] == 512
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 32 * 2
    expected = {"episode_return", "episode_length", "episodes", "loss", "q_mean", "epsilon"}
    assert expected <= set(rows[0])
    losses = [float(r["loss"]) for r in rows]
    assert np.isnan(losses[: 7 * 2]).all() and np.isfinite(losses[7 * 2 :]).all()

    state = checkpoint_state(purejaxrl_dqn, run_dir)
    kernel = state.params["params"]["Dense_0"]["kernel"]  # [devices, seeds, ...]
    assert not np.allclose(kernel[:, 0], kernel[:, 1])  # independent initialisation
    actions = state.buffer.data.action
    assert (actions[:, 0] != actions[:, 1]).mean() > 0.3  # independent exploration
    assert not np.allclose(state.buffer.data.obs[:, 0], state.buffer.data.obs[:, 1])
    assert int(state.buffer.size[0, 0]) == 64 and int(state.timesteps[0, 0]) == 512


def test_vmapped_run_equals_single_run(tiny_dqn_args):
    """Seed i of sweep configuration k equals a single run with that seed and those values;
    the sweep varies an integer hyperparameter too."""
    sweep = ["--sweep", "target-network-frequency=32,64", "gamma=0.9,0.99"]
    together = train([*tiny_dqn_args, "--seed", "1", "--num-seeds", "2", *sweep])
    alone = train(
        [*tiny_dqn_args, "--seed", "2", "--target-network-frequency", "64", "--gamma", "0.9"]
    )
    assert_seed_matches_single_run(together, 2 * 2 + 1, alone)  # configuration 2, seed index 1


def test_two_devices_share_parameters_not_environments(tiny_dqn_args):
    result = run_script("purejaxrl_dqn.py", *tiny_dqn_args, "--num-devices", "2", devices=2)
    assert result.returncode == 0, result.stderr
    (run_dir,) = (p for p in os.scandir(tiny_dqn_args[-1]))
    with open(os.path.join(run_dir.path, "summary.json")) as f:
        assert json.load(f)["num_devices"] == 2
    state = checkpoint_state(purejaxrl_dqn, run_dir.path)
    assert state.buffer.data.action.shape[1:3] == (1, 64)  # [devices, seeds, rows, envs/device]
    # Networks, optimiser and counters are shared; environments, their data and keys are not.
    assert_devices_share_all_but(state, (".buffer.data", ".env_state", ".obs", ".key"))


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_continuous_env_exits_2_with_one_sentence(tmp_path):
    result = run_script("purejaxrl_dqn.py", "--env", "Pendulum", "--runs-dir", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr == (
        "error: DQN needs a discrete action space; Pendulum-v1 has continuous actions\n"
    )
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--n-step", "0"], "--n-step must be >= 1, got 0"),
        (["--gradient-steps", "0"], "--gradient-steps must be >= 1"),
        (["--buffer-size", "8"], "--buffer-size 8 is smaller than --batch-size 16"),
        (["--buffer-size", "12", "--batch-size", "8"], "keeps only 3 steps of each of the 4"),
        (["--total-timesteps", "15"], "less than one update"),
        (["--learning-starts", "512"], "--learning-starts 512 leaves no gradient step"),
        (["--gamma", "1.5"], r"--gamma must be a finite number in \[0, 1\], got 1.5"),
        (["--tau", "0"], r"--tau must be a finite number in \(0, 1\], got 0.0"),
        (["--max-grad-norm", "-1"], r"--max-grad-norm must be a finite number in \[0, inf\)"),
        (
            ["--learning-rate", "nan"],
            r"--learning-rate must be a finite number in \(0, 1\], got nan",
        ),
        (["--end-e", "inf"], "--end-e must be a finite number"),
        (["--sweep", "lr=1e-3,nan"], "--learning-rate must be a finite number"),
        (["--buffer-size", "1000000000000"], "--buffer-size must be <= 2147483647"),
        (["--buffer-size", "2000000000"], r"the training state needs about [\d,.]+ GiB"),
        # an int32 hyperparameter, and a layer width, past 2**31 - 1
        (["--target-network-frequency", "2147483648"], "--target-network-frequency must be <="),
        (["--sweep", "target-network-frequency=64,1e10"], "--target-network-frequency must be <="),
        (["--hidden-sizes", "16", "2147483648"], r"sizes in \[1, 2147483647\], got \(16, "),
    ],
)
def test_bad_flags_raise_config_error(tiny_dqn_args, flags, match):
    with pytest.raises(ConfigError, match=match):
        train([*tiny_dqn_args, *flags])


def test_sizes_not_divisible_by_devices():
    with pytest.raises(ConfigError, match="--num-envs 3 is not divisible by the 2 devices"):
        validate(Config(num_envs=3), Runtime(num_devices=2))
    with pytest.raises(ConfigError, match="--batch-size 127 is not divisible by the 2 devices"):
        validate(Config(batch_size=127), Runtime(num_devices=2))


@pytest.mark.parametrize("tau", [1.0, 0.5])
def test_target_network_lags_and_syncs_every_target_network_frequency_env_steps(tau):
    """4 envs x 1 step per update: 4 env steps per update, a sync every 12 env steps, so at
    updates 3, 6, 9, ... once learning has started (env step 8), and never in between. tau 1
    copies the online network; tau 0.5 averages it with the old target."""
    config = Config(
        num_envs=4, total_timesteps=160, learning_starts=8, buffer_size=64, batch_size=8,
        target_network_frequency=12, tau=tau, hidden_sizes=(8,),
    )  # fmt: skip
    trainer = make_train(config)
    one_update = jax.jit(jax.vmap(lambda s: trainer.train_chunk(s, 1)[0], axis_name=DEVICE_AXIS))
    state = jax.vmap(trainer.init, (0, None), axis_name=DEVICE_AXIS)(
        jax.random.PRNGKey(0)[None], trainer.hyperparams
    )

    def leaf(params):
        return np.asarray(jax.tree.leaves(params)[0])

    for update in range(1, 11):
        old_target = leaf(state.target_params)
        state = one_update(state)
        online, target = leaf(state.params), leaf(state.target_params)
        if update % 3 == 0:
            np.testing.assert_allclose(target, tau * online + (1 - tau) * old_target, rtol=1e-6)
        else:
            np.testing.assert_array_equal(target, old_target)
        if update >= 3:  # learning has started: between syncs, the target lags
            assert not np.allclose(online, target) or (update % 3 == 0 and tau == 1.0)
