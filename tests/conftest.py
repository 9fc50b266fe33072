import os
import shutil
import tempfile

import pytest

from utils.devices import LLVM_LEVEL_FLAG, xla_flags_with

# Tests never talk to wandb's servers.
os.environ.setdefault("WANDB_MODE", "disabled")

# One persistent JAX compilation cache for the whole session, shared by the xdist workers and
# every subprocess: many tests train the same tiny programs, and a cache hit turns seconds of
# XLA compilation into a file read. Each session starts with an empty cache, so nothing
# compiled by older code is ever reused.
_CACHE_VARIABLE = "PUREJAXRL_TESTS_JAX_CACHE"
_OWNS_CACHE = _CACHE_VARIABLE not in os.environ  # the xdist controller, or a plain session
if _OWNS_CACHE:
    os.environ[_CACHE_VARIABLE] = tempfile.mkdtemp(prefix="purejaxrl-tests-jax-cache-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[_CACHE_VARIABLE]
# hypothesis (tests/test_flags.py) keeps its caches there too, not in the repository.
os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(os.environ[_CACHE_VARIABLE], "hypothesis")

# The suite compiles dozens of programs that then run for a second or two, so XLA's LLVM
# backend works at optimisation level 0, which compiles fastest. The learning tests train for
# tens of seconds, where code compiled at level 0 runs markedly slower; they run in
# subprocesses at level 1 (`run_script(..., llvm_level=1)`). Subprocesses otherwise inherit
# level 0. The timings are in docs/benchmarks.md, "Test suite". This must come before anything
# imports gymnax (tests.helpers does), for XLA reads the flags when that import starts JAX's
# backend; xdist's workers and the subprocesses inherit them.
if LLVM_LEVEL_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = xla_flags_with(LLVM_LEVEL_FLAG, 0)


def pytest_configure(config):
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(os.environ[_CACHE_VARIABLE], ignore_errors=True)


@pytest.fixture
def tiny_ppo_args(tmp_path):
    """A PPO CartPole run of 8 updates in 4 chunks: compiles in seconds, runs in a blink."""
    from tests.helpers import TINY_PPO

    return ["--env", "CartPole", *TINY_PPO, "--no-progress", "--runs-dir", str(tmp_path / "runs")]
