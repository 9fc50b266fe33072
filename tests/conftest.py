import os
import shutil
import tempfile

import pytest

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

# The suite compiles dozens of programs that then run for seconds: at LLVM optimisation level 1
# a small AlphaZero run compiled 15-20% faster than at XLA's default level and ran 3-13%
# slower. The subprocesses inherit it (tests.helpers.run_script keeps it).
_LLVM_LEVEL = "--xla_backend_optimization_level=1"
if _LLVM_LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LLVM_LEVEL}".strip()


def pytest_configure(config):
    import jax

    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_VARIABLE])


def pytest_unconfigure(config):
    if _OWNS_CACHE:
        shutil.rmtree(os.environ[_CACHE_VARIABLE], ignore_errors=True)


@pytest.fixture
def tiny_ppo_args(tmp_path):
    """A PPO CartPole run of 8 updates in 4 chunks: compiles in seconds, runs in a blink."""
    return [
        "--env", "CartPole",
        "--num-envs", "4",
        "--num-steps", "16",
        "--num-minibatches", "2",
        "--update-epochs", "2",
        "--total-timesteps", "512",
        "--updates-per-chunk", "2",
        "--eval-episodes", "2",
        "--no-progress",
        "--runs-dir", str(tmp_path / "runs"),
    ]  # fmt: skip
