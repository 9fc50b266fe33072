"""Device helpers that change how programs are built, never what they compute."""

import json
import os
import sys

import jax
import numpy as np
import pytest

import purejaxrl_az
import purejaxrl_dqn
import purejaxrl_ppo
from tests.helpers import TINY_AZ, TINY_DQN, TINY_PPO, run_script
from utils import driver
from utils.cli import parse_config
from utils.devices import (
    DEVICE_AXIS,
    compile_for_one_call,
    device_mean,
    device_sum,
    split_cpu_host,
    unroll_threefry_on_cpu,
)
from utils.errors import ConfigError


def test_unrolled_threefry_draws_the_same_numbers_without_a_loop():
    def draws(key):
        uniform_key, int_key = jax.random.split(key)
        return jax.random.uniform(uniform_key, (7,)), jax.random.randint(int_key, (5,), 0, 100)

    key = jax.random.PRNGKey(42)
    try:
        unroll_threefry_on_cpu(False)
        rolled = jax.jit(draws).lower(key).compile()
        unroll_threefry_on_cpu(True)
        unrolled = jax.jit(lambda k: draws(k)).lower(key).compile()  # a new function: relowered
    finally:
        unroll_threefry_on_cpu(False)  # as every trainer's run leaves it
    assert " while(" in rolled.as_text() and " while(" not in unrolled.as_text()
    for a, b in zip(rolled(key), unrolled(key), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "module, args",
    [
        (purejaxrl_ppo, ["--env", "CartPole", *TINY_PPO]),
        (purejaxrl_dqn, TINY_DQN),
        (purejaxrl_az, TINY_AZ),
    ],
    ids=["ppo", "dqn", "az"],
)
def test_the_initial_state_compiles_with_simple_kernels_to_the_same_numbers(
    module, args, tmp_path, monkeypatch
):
    """The driver compiles each run's initial state with XLA:CPU's simpler kernels, a program
    other than the default kernels' that computes the same bits."""
    extra = {"preset_key": module.resolve_game} if module is purejaxrl_az else {}
    config = parse_config(
        module.Config, module.PRESETS, [*args, "--runs-dir", str(tmp_path)], **extra
    )
    plan = driver.plan_runs(config, module.make_train, module.validate)
    compiled = []  # (the driver's options, the program compiled)

    def compiling(**overridden):
        def recorded(lowered, **options):
            compiled.append((options, compile_for_one_call(lowered, **{**options, **overridden})))
            return compiled[-1][1]

        return recorded

    monkeypatch.setattr(driver, "compile_for_one_call", compiling())
    state, _ = driver.start_or_resume(plan, driver._Clock(wall_start=0.0))
    monkeypatch.setattr(driver, "compile_for_one_call", compiling(simple_kernels=False))
    default_state, _ = driver.start_or_resume(plan, driver._Clock(wall_start=0.0))
    (options, simple), (_, default) = compiled
    assert options == {"simple_kernels": True}
    assert default.as_text() != simple.as_text()
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(default_state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_device_reductions_are_the_identity_on_one_device():
    # Several devices, across processes too, are covered by tests/test_multihost.py.
    def reduce(x):
        return device_sum(x), device_mean(x)

    one = jax.pmap(reduce, axis_name=DEVICE_AXIS)
    assert "all-reduce" not in one.lower(np.ones((1, 3))).compile().as_text()
    total, mean = one(np.arange(3.0)[None])
    np.testing.assert_array_equal(total[0], [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(mean[0], [0.0, 1.0, 2.0])


def test_a_process_not_started_as_a_script_is_never_restarted():
    """Under pytest (python -m pytest), as in a notebook, a CPU split that needs a restart is
    refused with a sentence instead of re-executing the interpreter."""
    with pytest.raises(ConfigError, match=r"needs a fresh process.*XLA_FLAGS="):
        split_cpu_host(jax.local_device_count() + 1)
    split_cpu_host(0)  # nothing to change: no restart, no error


def test_compiled_programs_go_to_the_per_user_cache_unless_turned_off(tmp_path):
    """Without $JAX_COMPILATION_CACHE_DIR, a run caches its programs under $XDG_CACHE_HOME, and
    the same command in a fresh process loads them instead of compiling: it writes no program
    of its own (a cache key that changed from run to run would), and what remains of its
    compile time is tracing and lowering. --no-compile-cache writes none."""

    def compile_seconds(cache_home, *flags) -> float:
        runs_dir = tmp_path / "runs" / str(len(list(tmp_path.glob("runs/*"))))
        result = run_script(
            "purejaxrl_ppo.py",
            *["--env", "CartPole", *TINY_PPO, "--no-progress", "--runs-dir", str(runs_dir)],
            *flags,
            env_extra={"JAX_COMPILATION_CACHE_DIR": "", "XDG_CACHE_HOME": str(cache_home)},
        )
        assert result.returncode == 0, result.stderr[-2000:]
        (summary,) = runs_dir.glob("*/summary.json")
        return json.loads(summary.read_text())["compile_seconds"]

    def trainer_programs() -> set[str]:
        # the init, chunk and evaluation programs; a tiny program such as a key split may
        # cross the 0.1 s bar for a file on one run and not the other, on a busy machine
        return {name for name in os.listdir(cache) if name.startswith(("jit__fun", "jit_evaluate"))}

    first = compile_seconds(tmp_path / "on")
    cache = tmp_path / "on" / "purejaxrl" / "jax"
    written = trainer_programs()
    assert len(written) == 3, written
    second = compile_seconds(tmp_path / "on")
    assert trainer_programs() == written
    # about a third on an idle machine (docs/benchmarks.md, "Compile cache"); half at most
    # when other processes compile beside it
    assert second < 0.75 * first, (first, second)
    compile_seconds(tmp_path / "off", "--no-compile-cache")
    assert not (tmp_path / "off" / "purejaxrl").exists()


def test_a_refused_distributed_run_leaves_the_environment_as_it_was(monkeypatch):
    """--distributed from `python -c CODE`, which could restart to split the CPU but is no
    trainer script to launch in a process group, is refused, and the refusal leaves neither
    XLA_FLAGS nor the restart markers behind for the next run in this process."""
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-c", "pass"])
    monkeypatch.setattr(os, "environ", dict(os.environ))  # nothing leaks should this fail
    environment = dict(os.environ)
    processes = {"coordinator_address": None, "num_processes": 2, "process_id": 0}
    with pytest.raises(ConfigError, match="--distributed runs start from a trainer script"):
        split_cpu_host(jax.local_device_count() + 1, processes)
    assert dict(os.environ) == environment
