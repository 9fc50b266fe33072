"""Craftax, xminigrid and Brax behind the gymnax interface of utils/envs.py: their adapters'
flags, final observations and episode statistics, a tiny PPO run of each through the script
with a resume, DQN on the discrete ones, and the lazy imports that keep a gymnax run free of
them."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import purejaxrl_dqn
import purejaxrl_ppo
from tests.helpers import (
    REPO,
    TINY_DQN,
    TINY_PPO,
    assert_identical_runs,
    interrupt_after_update_4,
)
from utils import driver
from utils.cli import parse_config
from utils.driver import run_training
from utils.envs import (
    BRAX_NAMES,
    XMINIGRID_IDS,
    env_family,
    make_env,
    resolve_env_id,
)
from utils.errors import ConfigError

# One env per family; Brax's inverted pendulum compiles fastest of its envs.
FAMILY_ENVS = {
    "craftax": "Craftax-Classic",
    "gridworld": "MiniGrid-DoorKey-5x5",
    "brax": "brax:inverted_pendulum",
}
MAX_STEPS = 4  # a time limit the tests reach


@pytest.mark.parametrize("family", FAMILY_ENVS)
def test_adapter_flags_final_observation_and_episode_tally(family):
    """Steps of 2 envs with random actions and a 4-step time limit, each compared with the
    adapter's own step without a reset from the same state and key: where an episode ends,
    `final_observation` is that step's observation, the returned state a fresh reset's, and
    the flags, return and length tally the steps."""
    env, params, spec = make_env(FAMILY_ENVS[family], max_episode_steps=MAX_STEPS)
    assert env_family(spec.env_id) == family and spec.max_episode_steps == MAX_STEPS
    adapter = env._env

    @jax.jit
    def step(key, state, action):
        step_key, reset_key = jax.random.split(key)
        plain = adapter.step_env(step_key, state.env_state, action, params)
        return env.step(key, state, action, params), plain, adapter.reset_env(reset_key, params)

    key = jax.random.PRNGKey(0)
    obs, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, 2), params)
    tally_return, tally_length, ended = np.zeros(2), np.zeros(2, int), 0
    for _ in range(2 * MAX_STEPS + 1):
        key, action_key, step_key = jax.random.split(key, 3)
        if spec.discrete:
            action = jax.random.randint(action_key, (2,), 0, spec.num_actions)
        else:
            action = jax.random.uniform(action_key, (2, spec.num_actions), minval=-1, maxval=1)
        outputs = jax.vmap(step)(jax.random.split(step_key, 2), state, action)
        (obs, state, reward, terminated, truncated, info), plain, (reset_obs, _) = outputs
        assert obs.shape == (2, *spec.obs_shape) and obs.dtype == jnp.float32
        assert not np.any(terminated & truncated)
        done = np.asarray(terminated | truncated)
        np.testing.assert_array_equal(info["final_observation"], plain[0])
        np.testing.assert_array_equal(obs, np.where(_rows(done, obs), reset_obs, plain[0]))
        tally_return += np.asarray(reward)
        tally_length += 1
        np.testing.assert_allclose(info["episode_return"], tally_return, rtol=1e-5)
        np.testing.assert_array_equal(info["episode_length"], tally_length)
        assert set(info["episode_stats"]) == set(spec.episode_stats)
        # The time limit: no episode runs past it, and one that reaches it is truncated.
        assert np.all(tally_length <= MAX_STEPS)
        np.testing.assert_array_equal(truncated, (tally_length == MAX_STEPS) & ~terminated)
        ended += done.sum()
        tally_return[done], tally_length[done] = 0.0, 0
        assert np.all(state.episode_length == tally_length)
    assert ended >= 4


def _rows(done, array):
    return done.reshape(-1, *[1] * (array.ndim - 1))


@pytest.mark.parametrize("family", FAMILY_ENVS)
def test_tiny_ppo_run_and_its_resume(family, tmp_path, monkeypatch):
    """The script's parse-and-train trains and logs the family's episode statistics (Craftax's
    achievement rate and score); the same run stopped by Ctrl-C after update 4 and resumed ends
    in the same final state and metrics (the env state, a Craftax world, an xminigrid TimeStep
    or a Brax State, goes through the checkpoint). In this process, so that the runs after the
    first reuse its compiled programs."""
    whole, runs = tmp_path / "whole", tmp_path / "runs"
    # a checkpoint after every chunk: the stop below comes after update 4's
    args = ["--env", FAMILY_ENVS[family], *TINY_PPO, "--no-progress", "--checkpoint-every", "1"]
    if family != "gridworld":
        # No evaluation: its own compile of the env's step, and for Craftax episodes that a
        # random policy keeps alive for thousands of steps; the gridworld run evaluates.
        args += ["--eval-episodes", "0"]

    def train(args):
        config = parse_config(purejaxrl_ppo.Config, purejaxrl_ppo.PRESETS, args)
        return run_training(config, purejaxrl_ppo.make_train, purejaxrl_ppo.validate)

    whole_dir = train([*args, "--runs-dir", str(whole)])["run_dir"]
    with monkeypatch.context() as patch:
        patch.setattr(driver._Progress, "update", interrupt_after_update_4)
        with pytest.raises(SystemExit):
            train([*args, "--runs-dir", str(runs)])
    (run_dir,) = runs.iterdir()
    assert train(["--resume", str(run_dir), "--no-progress"])["resumed_from_update"] == 4
    assert_identical_runs(whole_dir, run_dir)
    header = (run_dir / "metrics.csv").read_text().splitlines()[0].split(",")
    spec = make_env(FAMILY_ENVS[family])[2]
    assert {"episode_return", "episode_length", *spec.episode_stats} <= set(header)


def test_dqn_trains_on_a_gridworld(tmp_path):
    """DQN takes the discrete families through the same factory (Craftax too: checked by hand,
    its compilation would double this test's time)."""
    args = [*TINY_DQN, "--env", "DoorKey", "--hidden-sizes", "16", "--no-progress"]
    config = parse_config(
        purejaxrl_dqn.Config, purejaxrl_dqn.PRESETS, [*args, "--runs-dir", str(tmp_path)]
    )
    summary = run_training(config, purejaxrl_dqn.make_train, purejaxrl_dqn.validate)
    assert np.isfinite(summary["eval_return_per_seed"][0])


def test_every_spelling_resolves_and_unknown_names_list_each_family():
    assert resolve_env_id("brax:hopper") == resolve_env_id("Hopper") == "hopper-brax"
    assert resolve_env_id("halfcheetah") == resolve_env_id("HalfCheetah") == "halfcheetah-brax"
    assert resolve_env_id("craftax") == "Craftax-Symbolic-v1"
    assert resolve_env_id("Craftax-Classic") == "Craftax-Classic-Symbolic-v1"
    assert resolve_env_id("doorkey-8x8") == "MiniGrid-DoorKey-8x8"
    with pytest.raises(ConfigError) as error:
        resolve_env_id("Hoper")
    message = str(error.value)
    for family in ("gymnax:", "craftax:", "xminigrid:", "brax:"):
        assert family in message
    for name in ("CartPole-v1", "Craftax-Symbolic-v1", "MiniGrid-DoorKey-5x5", "hopper-brax"):
        assert name in message


def test_the_name_tables_match_the_installed_packages():
    """The names are tables in utils/envs.py, so that resolving one imports no package: they
    must list what the packages register (less xminigrid's XLand envs, whose rulesets download
    at run time, and Brax's test env)."""
    import xminigrid
    from brax import envs

    registered = xminigrid.registered_environments()
    assert set(XMINIGRID_IDS) == {i for i in registered if not i.startswith("XLand-")}
    assert set(BRAX_NAMES) == set(envs._envs) - {"fast"}


def _fresh_python(code: str) -> str:
    """What `code` prints, run in a fresh interpreter in the repository."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_gymnax_run_imports_no_other_env_package():
    """Planning a CartPole run (parse, validate, build the trainer) leaves brax, craftax and
    xminigrid unimported."""
    code = (
        "import sys, purejaxrl_ppo as p\n"
        "from utils.cli import parse_config\n"
        "from utils.trainer import Runtime\n"
        "config = parse_config(p.Config, p.PRESETS, ['--env', 'CartPole'])\n"
        "p.validate(config, Runtime())\n"
        "p.make_train(config)\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'brax', 'craftax', 'xminigrid'}))"
    )
    assert _fresh_python(code).splitlines()[-1] == "[]"


def test_gymnax_imports_seaborn_only_when_a_renderer_uses_it():
    """gymnax imports seaborn for two renderers (about 1.3 s of every gymnax run's start): the
    adapter leaves it unloaded until one of them looks a name up, and then it works."""
    code = (
        "import sys\n"
        "from utils.envs import make_env\n"
        "make_env('CartPole')\n"
        "print('seaborn.palettes' in sys.modules)\n"
        "from gymnax.environments.misc import pong\n"
        "print(len(pong.sns.color_palette('cubehelix', 3)), type(sys.modules['seaborn']).__name__)"
    )
    assert _fresh_python(code).split() == ["False", "3", "module"]


def test_each_family_has_a_ppo_preset():
    from purejaxrl_ppo import PRESETS

    assert {"craftax", "gridworld", "brax"} <= set(PRESETS)
    assert PRESETS["brax"]["normalize_obs"] and PRESETS["brax"]["normalize_reward"]
    assert Path(REPO / "utils" / "env_brax.py").exists()


def test_capture_video_draws_a_gridworld_and_names_brax_without_a_renderer(tmp_path, capsys):
    from PIL import Image

    from utils.evaluation import memoryless
    from utils.video import write_episode_gif

    @memoryless
    def turn_clockwise(obs):  # in place until the time limit: every frame differs from the last
        return jnp.ones(obs.shape[0], jnp.int32)

    gif = write_episode_gif(
        "DoorKey", turn_clockwise, jax.random.PRNGKey(0), str(tmp_path / "a.gif")
    )
    with Image.open(gif) as frames:
        assert frames.n_frames == make_env("DoorKey")[2].max_episode_steps == 250
    assert write_episode_gif("Hopper", None, None, str(tmp_path / "b.gif")) is None
    assert capsys.readouterr().out.strip() == (
        "--capture-video: brax has no offline renderer for hopper-brax; no video written"
    )
