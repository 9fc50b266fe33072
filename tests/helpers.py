"""Helpers shared by the tests."""

import csv
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import gymnax
import jax
import numpy as np
from gymnax.environments.classic_control import cartpole

from utils import checkpoint
from utils.devices import (
    DEVICE_AXIS,
    LLVM_LEVEL_FLAG,
    xla_flags_with,
    xla_flags_with_cpu_devices,
)

REPO = Path(__file__).resolve().parent.parent


# The tiny runs the tests train, and the golden runs record: PPO's takes an --env, 8 updates in
# 4 chunks; DQN's 32 updates in 4 chunks, its 256-transition buffer wraps around and it learns
# from update 8 on; AlphaZero's 4 iterations in 2 chunks, each ending in an evaluation. Each
# compiles in seconds (AlphaZero: well under a minute) and runs in a blink.
TINY_PPO = [
    "--num-envs", "4",
    "--num-steps", "16",
    "--num-minibatches", "2",
    "--update-epochs", "2",
    "--total-timesteps", "512",
    "--updates-per-chunk", "2",
    "--eval-episodes", "2",
]  # fmt: skip
TINY_DQN = [
    "--env", "CartPole",
    "--num-envs", "4",
    "--train-frequency", "4",
    "--total-timesteps", "512",
    "--learning-starts", "128",
    "--buffer-size", "256",
    "--batch-size", "16",
    "--target-network-frequency", "64",
    "--n-step", "3",
    "--exploration-fraction", "0.5",  # the golden runs keep their schedule when the preset moves
    "--hidden-sizes", "16", "16",
    "--updates-per-chunk", "8",
    "--eval-episodes", "2",
]  # fmt: skip
TINY_AZ = [
    "--env", "tic_tac_toe",
    "--num-iterations", "4",
    "--eval-every", "2",
    "--num-games", "16",
    "--rollout-steps", "4",
    "--buffer-size", "128",
    "--minibatch-size", "32",
    "--updates-per-iteration", "2",
    "--num-blocks", "1",
    "--num-channels", "8",
    "--num-simulations", "4",
    "--max-num-considered-actions", "4",
    "--eval-games", "8",
    "--baseline-sims", "4",
    "--cpu-devices", "0",
]  # fmt: skip


def _script_env(devices=1, env_extra=None, llvm_level=None) -> dict:
    """The environment of a script run: fake CPU devices, the session's LLVM optimisation level
    unless `llvm_level` names another, which gets a cache directory of its own. JAX's cache
    key hashes XLA_FLAGS as the environment holds them when a program compiles, not as XLA
    read them at start, so a process that set them late stored programs under keys that
    misdescribe them (a `-n 0` session did, until tests/conftest.py set them first). That is
    the likely cause of the different 2048 games a level-0 process once played."""
    xla_flags = xla_flags_with_cpu_devices(devices)
    environment = dict(os.environ)
    if llvm_level is not None:
        xla_flags = xla_flags_with(LLVM_LEVEL_FLAG, llvm_level, xla_flags)
        if environment.get("JAX_COMPILATION_CACHE_DIR"):
            environment["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
                environment["JAX_COMPILATION_CACHE_DIR"], f"llvm-level-{llvm_level}"
            )
    return {**environment, "XLA_FLAGS": xla_flags, **(env_extra or {})}


def run_script(*args, devices=1, timeout=300, env_extra=None, llvm_level=None):
    """Run `python <args>` from the repo root in a fresh process (fake CPU devices if asked),
    at the session's LLVM optimisation level unless `llvm_level` names another."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=_script_env(devices, env_extra, llvm_level),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_script(*args, env_extra=None) -> subprocess.Popen:
    """Start `python <args>` as `run_script` would, without waiting: stderr is a text pipe.
    Ctrl-C reaches it as from a terminal, even where a shell script started this process in
    the background, which makes it and its children ignore SIGINT."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # what a child inherits, not a handler
    try:
        return subprocess.Popen(
            [sys.executable, *args],
            cwd=REPO,
            env=_script_env(env_extra=env_extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def summary_of_only_run(runs_dir: Path) -> dict:
    """summary.json of the one run directory under `runs_dir`."""
    (run_dir,) = runs_dir.iterdir()
    return json.loads((run_dir / "summary.json").read_text())


def checkpoint_leaves(run_dir) -> dict[str, np.ndarray]:
    """All arrays of the latest checkpoint in a run directory, by leaf index."""
    directory = os.path.join(run_dir, "checkpoints")
    assert checkpoint.updates(directory), f"no checkpoint in {run_dir}"
    leaves, _ = checkpoint.read(directory)
    return {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}


def checkpoint_state(trainer_module, run_dir):
    """The latest checkpoint of a run of `trainer_module` (purejaxrl_dqn, ...) as its training
    state, leaves [devices, runs, ...]."""
    with open(os.path.join(run_dir, "config.json")) as f:
        config = trainer_module.Config(**json.load(f))
    trainer = trainer_module.make_train(config)
    shapes = jax.eval_shape(
        jax.vmap(lambda key: trainer.init(key, trainer.hyperparams), axis_name=DEVICE_AXIS),
        jax.random.split(jax.random.PRNGKey(0), 1),
    )
    leaves = checkpoint_leaves(run_dir)
    return jax.tree.unflatten(
        jax.tree.structure(shapes), [leaves[f"{i:05d}"] for i in range(len(leaves))]
    )


def assert_devices_share_all_but(state, per_device: tuple[str, ...]):
    """A state trained on 2 devices (leaves [devices, runs, ...]): every leaf is the same on
    both devices (parameters, optimiser, statistics, counters), except the leaves under the
    fields `per_device` (paths such as ".buffer.data"), each device's own environments, data
    and keys; in each of those fields some leaf differs."""
    differing = {field: [] for field in per_device}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        field = next((f for f in per_device if name.startswith(f)), None)
        if field is None:
            np.testing.assert_array_equal(leaf[0], leaf[1], err_msg=f"{name} differs by device")
        elif not np.array_equal(leaf[0], leaf[1]):
            differing[field].append(name)
    same = [field for field, names in differing.items() if not names]
    assert not same, f"{same} are the same on both devices"


def _summary(run_dir) -> dict:
    """summary.json of a finished run ({} while it is unfinished)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def metric_table(run_dir, seed_index, config_index=0) -> np.ndarray:
    """metrics.csv of one seed (of one sweep configuration) as [updates, metrics], without the
    columns that name the run."""
    swept = _summary(run_dir).get("sweep", {}).get("parameters", [])
    with open(os.path.join(run_dir, "metrics.csv"), newline="") as f:
        rows = [
            r
            for r in csv.DictReader(f)
            if int(r["seed"]) == seed_index and int(r.get("config", 0)) == config_index
        ]
    names = [k for k in rows[0] if k not in ("update", "env_steps", "seed", "config", *swept)]
    return np.array([[float(r[k]) for k in names] for r in rows])


def assert_identical_runs(first_dir, second_dir):
    """Same metrics and the same final training state, bit for bit."""
    np.testing.assert_array_equal(metric_table(first_dir, 0), metric_table(second_dir, 0))
    a, b = checkpoint_leaves(first_dir), checkpoint_leaves(second_dir)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def assert_seed_matches_single_run(together: dict, index: int, alone: dict):
    """Run `index` of a vmapped run (summary dicts; runs are sweep configurations x seeds,
    configuration-major) equals a single run with that seed and those hyperparameters."""
    assert together["eval_return_per_seed"][index] == alone["eval_return_per_seed"][0]
    num_configs = together.get("sweep", {}).get("num_configs", 1)
    num_seeds = len(together["seeds"]) // num_configs
    config_index, seed_index = divmod(index, num_seeds)
    together, alone = together["run_dir"], alone["run_dir"]
    # Batched and unbatched matmuls may round differently: equal up to float32 noise.
    np.testing.assert_allclose(
        metric_table(together, seed_index, config_index),
        metric_table(alone, 0),
        rtol=1e-4,
        atol=1e-6,
    )
    a, b = checkpoint_leaves(together), checkpoint_leaves(alone)
    for name in a:  # every leaf is [devices, runs, ...]
        np.testing.assert_allclose(a[name][:, index], b[name][:, 0], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# PPO: plain references and one update step watched from outside
# ---------------------------------------------------------------------------------------------


def gae_reference(rewards, values, last_value, final_values, terminated, truncated, gamma, lam):
    """Textbook GAE, one environment and one step at a time."""
    num_steps, num_envs = rewards.shape
    advantages = np.zeros((num_steps, num_envs))
    for n in range(num_envs):
        next_advantage = 0.0
        for t in reversed(range(num_steps)):
            if terminated[t, n]:
                next_value = 0.0
            elif truncated[t, n]:
                next_value = final_values[t, n]
            elif t + 1 < num_steps:
                next_value = values[t + 1, n]
            else:
                next_value = last_value[n]
            delta = rewards[t, n] + gamma * next_value - values[t, n]
            episode_ended = terminated[t, n] or truncated[t, n]
            next_advantage = delta + (0.0 if episode_ended else gamma * lam * next_advantage)
            advantages[t, n] = next_advantage
    return advantages, advantages + values


def train_one_update(ppo, monkeypatch, config, updates_before=0, **env_params):
    """One update step of the real trainer of the PPO module `ppo`, with these gymnax env params
    replaced, watched from outside: its state before and after, the rollout it collected and
    the advantages and targets it learned from (as `rollout_targets` returned them), every
    action its environments received and, in order, every batch its running statistics took
    in (`batch_stats`, with --normalize-obs or --normalize-reward). Leaves without the device
    axis. With `updates_before`, the watched update is the last of the config's that many + 1
    updates: its rollout starts in the middle of episodes."""
    seen = {"env_actions": [], "stats_batches": []}
    make_env, targets_of = ppo.make_env, ppo.rollout_targets
    stats_of = ppo.batch_stats

    class ActionRecorder:
        """The environment, recording every action it receives."""

        def __init__(self, env):
            self.env = env

        def __getattr__(self, name):
            return getattr(self.env, name)

        def step(self, key, state, action, params):
            jax.debug.callback(seen["env_actions"].append, action)
            return self.env.step(key, state, action, params)

    def make_watched_env(name):
        env, params, spec = make_env(name)
        params = params.replace(**env_params)
        spec = spec._replace(max_episode_steps=int(params.max_steps_in_episode))
        return ActionRecorder(env), params, spec

    def watched_targets(traj, last_value, gamma, gae_lambda):
        advantages, targets = targets_of(traj, last_value, gamma, gae_lambda)
        jax.debug.callback(
            lambda traj, advantages, targets: seen.update(
                rollout=traj, advantages=advantages, targets=targets
            ),
            traj,
            advantages,
            targets,
        )
        return advantages, targets

    def watched_stats(x):
        jax.debug.callback(lambda x: seen["stats_batches"].append(np.asarray(x)), x)
        return stats_of(x)

    monkeypatch.setattr(ppo, "make_env", make_watched_env)
    monkeypatch.setattr(ppo, "rollout_targets", watched_targets)
    monkeypatch.setattr(ppo, "batch_stats", watched_stats)
    trainer = ppo.make_train(config)
    assert trainer.num_updates == updates_before + 1
    # pmapped over one device, as the driver runs a single run
    on_device = functools.partial(jax.pmap, axis_name=DEVICE_AXIS, devices=jax.devices()[:1])
    start = on_device(trainer.init, in_axes=(0, None))(
        jax.random.PRNGKey(0)[None], trainer.hyperparams
    )
    if updates_before:
        start, _ = on_device(lambda state: trainer.train_chunk(state, updates_before))(start)
        jax.effects_barrier()
        seen["env_actions"].clear()
        seen["stats_batches"].clear()
    end, _ = on_device(lambda state: trainer.train_chunk(state, 1))(start)
    jax.effects_barrier()
    assert "rollout" in seen, "the update step no longer calls rollout_targets"
    without_device_axis = functools.partial(jax.tree.map, lambda x: np.asarray(x[0]))
    return {**seen, "start": without_device_axis(start), "end": without_device_axis(end)}


# Rollouts that cut CartPole off by a short time limit: (num_steps, time limit, updates before
# the watched one). A rollout longer than the time limit values each step's truncations at the
# step; one no longer than it, after the rollout.
TRUNCATING_ROLLOUTS = {"longer": (64, 20, 0), "as_long": (16, 16, 2)}


def train_truncating_update(ppo, monkeypatch, rollout: str, **config_fields):
    """(config, `train_one_update`'s record) of one of TRUNCATING_ROLLOUTS: 8 CartPole
    environments, 2 minibatches, 1 epoch, and `config_fields`."""
    num_steps, time_limit, updates_before = TRUNCATING_ROLLOUTS[rollout]
    config = ppo.Config(
        num_envs=8,
        num_steps=num_steps,
        num_minibatches=2,
        update_epochs=1,
        total_timesteps=8 * num_steps * (updates_before + 1),
        **config_fields,
    )
    seen = train_one_update(
        ppo, monkeypatch, config, updates_before=updates_before, max_steps_in_episode=time_limit
    )
    return config, seen


def cartpole_stepped(obs, action):
    """CartPole's observations [...] one step of its dynamics on (before any reset)."""
    env, env_params = gymnax.make("CartPole-v1")

    def stepped(obs, action):
        x, x_dot, theta, theta_dot = obs
        state = cartpole.EnvState(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot, time=0)
        return env.step_env(jax.random.PRNGKey(0), state, action, env_params)[0]

    batch_axes = obs.ndim - 1
    for _ in range(batch_axes):
        stepped = jax.vmap(stepped)
    return np.asarray(stepped(obs, action))


def interrupt_after_update_4(progress, done: int, *_):
    """`utils.driver._Progress.update` that raises KeyboardInterrupt once update 4 is done, as
    an exit at once would there: the run keeps the checkpoints it wrote by then."""
    if done == 4:
        raise KeyboardInterrupt
