"""Ctrl-C and SIGTERM, sent for real to trainer processes at each moment of a run: exit code 130
and one line on stderr (after the notice of a stop at the next safe point), never a traceback;
no run directory without a checkpoint; with one, a resume in a fresh process that ends exactly
where an uninterrupted run ends."""

import glob
import json
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

import purejaxrl_dqn
import purejaxrl_ppo
from tests.helpers import (
    TINY_DQN,
    TINY_PPO,
    assert_identical_runs,
    checkpoint_leaves,
    run_script,
    start_script,
)
from utils import interrupts
from utils.cli import parse_config
from utils.driver import run_training

# Short chunks, each followed by a checkpoint: PPO 12 updates in 12 chunks, DQN 32 in 8.
EVERY_CHUNK = ["--checkpoint-every", "1"]
PPO_ARGS = [
    "--env", "CartPole", *TINY_PPO, "--total-timesteps", "768", "--updates-per-chunk", "1",
    *EVERY_CHUNK,
]  # fmt: skip
DQN_ARGS = [*TINY_DQN, "--updates-per-chunk", "4", *EVERY_CHUNK]
TRAINERS = {"ppo": (purejaxrl_ppo, PPO_ARGS), "dqn": (purejaxrl_dqn, DQN_ARGS)}
# A compile that cannot be a cache hit, so that a signal sent as the run starts finds it going.
UNCACHED = {"JAX_ENABLE_COMPILATION_CACHE": "false"}
TIMEOUT = 120


def uninterrupted(algo: str, runs_dir) -> str:
    """The run directory of the trainer's uninterrupted run, trained in this process."""
    trainer, args = TRAINERS[algo]
    config = parse_config(
        trainer.Config, trainer.PRESETS, [*args, "--no-progress", "--runs-dir", str(runs_dir)]
    )
    return run_training(config, trainer.make_train, trainer.validate)["run_dir"]


def command(algo: str, *args) -> list[str]:
    """The trainer script and its flags, then `args`."""
    trainer, algo_args = TRAINERS[algo]
    return [os.path.basename(trainer.__file__), *algo_args, *args, "--no-progress"]


@pytest.fixture
def launch():
    """`start_script`; a process still running at the end of the test (one that failed) is
    killed."""
    processes = []

    def start(*args, env_extra=None):
        processes.append(start_script(*args, env_extra=env_extra))
        return processes[-1]

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.communicate()


def wait_until(process, moment: Callable[[], Any]):
    """What `moment()` returns once it is true, polled every millisecond while the process
    runs."""
    deadline = time.monotonic() + TIMEOUT
    while not (found := moment()):
        assert process.poll() is None, f"exited with {process.returncode}: {process.stderr.read()}"
        assert time.monotonic() < deadline, f"not there after {TIMEOUT} s"
        time.sleep(0.001)
    return found


def wait_for(process, pattern: str) -> str:
    """The first path matching `pattern`, as soon as it exists."""
    return wait_until(process, lambda: glob.glob(pattern))[0]


def stopped(process, stop_signal, within: float = TIMEOUT) -> list[str]:
    """Send the signal; the process's stderr lines once it has exited, `within` seconds, with
    code 130."""
    process.send_signal(stop_signal)
    stderr = process.communicate(timeout=within)[1]
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    return stderr.strip().splitlines()


def notice(stop_signal) -> str:
    """The line of the first signal of a run."""
    name = "Ctrl-C" if stop_signal == signal.SIGINT else "SIGTERM"
    return (
        f"{name}: stopping after the chunk, compile or evaluation in progress; "
        f"{name} again stops at once"
    )


def resume_dir(line: str) -> str:
    assert "; continue with --resume " in line, line
    return line.split("--resume ")[-1]


def assert_same_run(run_dir: str, uninterrupted_dir: str):
    """The same metrics, final state and final numbers as the uninterrupted run."""
    assert_identical_runs(uninterrupted_dir, run_dir)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(uninterrupted_dir, "summary.json")) as f:
        expected = json.load(f)
    for key in ("final_per_seed", "eval_return_per_seed", "final_metrics_per_seed"):
        assert summary[key] == expected[key], key


def signals_taken_over(pid: int) -> bool:
    """Whether the process catches SIGTERM, which Python by itself does not (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & 1 << signal.SIGTERM - 1)


def jax_loading(pid: int) -> bool:
    """Whether the process has begun to import JAX: jaxlib's compiled library is mapped."""
    with open(f"/proc/{pid}/maps") as f:
        return "/jaxlib/" in f.read()


@pytest.mark.parametrize(
    ("stop_signal", "moment"),
    [
        pytest.param(signal.SIGINT, signals_taken_over, id="ctrl-c-before-jax"),
        pytest.param(signal.SIGINT, jax_loading, id="ctrl-c-importing-jax"),
        pytest.param(signal.SIGTERM, jax_loading, id="sigterm-importing-jax"),
    ],
)
def test_a_stop_during_the_imports_exits_at_once(tmp_path, launch, stop_signal, moment):
    """The trainer takes the signals over before its slow imports (jax, flax, gymnax): a stop
    during them prints no traceback, and none gets lost in a weakref callback."""
    process = launch(*command("ppo", "--runs-dir", str(tmp_path)))
    wait_until(process, lambda: moment(process.pid))
    assert moment is jax_loading or not jax_loading(process.pid)
    assert stopped(process, stop_signal) == ["interrupted before the run started"]
    assert not os.listdir(tmp_path)


def test_a_stop_during_the_first_compile_lets_it_finish_and_leaves_no_directory(tmp_path, launch):
    process = launch(*command("ppo", "--runs-dir", str(tmp_path)), env_extra=UNCACHED)
    run_dir = os.path.dirname(wait_for(process, f"{tmp_path}/*/config.json"))
    lines = stopped(process, signal.SIGTERM)
    assert lines == [
        notice(signal.SIGTERM),
        f"interrupted before the first checkpoint; removed {run_dir}",
    ]
    assert not os.listdir(tmp_path)


def test_a_second_ctrl_c_exits_at_once(tmp_path, launch):
    """A run of one chunk of minutes, stopped twice: the second Ctrl-C does not wait for it."""
    one_long_chunk = ["--total-timesteps", "10000000", "--updates-per-chunk", "156250"]
    process = launch(*command("ppo", *one_long_chunk, "--runs-dir", str(tmp_path)))
    run_dir = os.path.dirname(wait_for(process, f"{tmp_path}/*/config.json"))
    process.send_signal(signal.SIGINT)
    first_line = next((line for line in iter(process.stderr.readline, "") if line.strip()), "")
    assert first_line.strip() == notice(signal.SIGINT)
    lines = stopped(process, signal.SIGINT, within=5)
    assert lines[-1] == f"interrupted before the first checkpoint; removed {run_dir}"
    assert not os.listdir(tmp_path)


def test_ppo_stopped_between_chunks_then_in_the_final_report_resumes_to_the_same_run(
    tmp_path, launch
):
    """Ctrl-C after a chunk, then SIGTERM as the process exits; the resume, in a fresh
    process, gets SIGTERM during its final report, which it finishes, then exits 130 all the
    same: the run is complete."""
    process = launch(*command("ppo", "--runs-dir", str(tmp_path / "stopped")))
    wait_for(process, f"{tmp_path}/stopped/*/checkpoints/update_00000002")
    process.send_signal(signal.SIGINT)
    lines = [process.stderr.readline().strip() for _ in range(3)]  # a blank line first
    assert lines[1] == notice(signal.SIGINT)
    run_dir = resume_dir(lines[2])
    # Another signal as the process exits, when Python's teardown would have restored its
    # default handlers (killed by SIGTERM: -15): exit code 130 all the same, and no other line.
    time.sleep(0.3)
    assert stopped(process, signal.SIGTERM) == []
    assert not os.path.exists(os.path.join(run_dir, "summary.json"))

    process = launch("purejaxrl_ppo.py", "--resume", run_dir, "--no-progress")
    wait_for(process, f"{run_dir}/learning_curve.png")  # the report goes on: summary.json
    lines = stopped(process, signal.SIGTERM)
    assert lines == [notice(signal.SIGTERM), f"interrupted after the run finished -> {run_dir}"]
    assert os.path.getsize(f"{run_dir}/learning_curve.png")  # the report was finished first
    assert os.path.exists(f"{run_dir}/summary.json")
    assert_same_run(run_dir, uninterrupted("ppo", tmp_path / "uninterrupted"))


# The DQN command line, whose second checkpoint write is interrupted by a SIGTERM to itself: the
# signal arrives after the write has begun and before it has renamed the finished checkpoint.
SIGTERM_DURING_THE_SECOND_WRITE = """
import os, signal, sys
import purejaxrl_dqn
from utils import checkpoint

real_write, calls = checkpoint._write, []

def write(path, arrays):
    calls.append(path)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    real_write(path, arrays)

checkpoint._write = write
sys.argv = sys.argv[1:]  # the script and its flags
purejaxrl_dqn.main()
"""


def test_dqn_stopped_during_a_checkpoint_write_resumes_to_the_uninterrupted_run(tmp_path):
    """SIGTERM while a checkpoint is written: the write finishes, the checkpoint reads back,
    and the replay buffer in it resumes exactly."""
    result = run_script(
        "-c", SIGTERM_DURING_THE_SECOND_WRITE, *command("dqn", "--runs-dir", str(tmp_path))
    )
    assert result.returncode == 130, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[0] == notice(signal.SIGTERM) and len(lines) == 2, lines
    assert "interrupted after update 8; continue with --resume " in lines[1]
    run_dir = resume_dir(lines[1])
    assert os.listdir(os.path.join(run_dir, "checkpoints")) == ["update_00000008"]
    assert checkpoint_leaves(run_dir)  # readable
    resumed = run_script("purejaxrl_dqn.py", "--resume", run_dir, "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run_dir, uninterrupted("dqn", tmp_path / "uninterrupted"))


def test_the_stop_notice_is_out_before_the_stop_is_asked_for(monkeypatch):
    """The listening thread says the notice, then asks for the stop: a main thread that stops
    on that request prints its exit line after the notice, never before it."""
    said = []
    monkeypatch.setattr(
        interrupts, "_say", lambda line: said.append((line, interrupts.stop_requested()))
    )
    monkeypatch.setattr(interrupts._state, "at_safe_points", True)
    monkeypatch.setattr(interrupts._state, "requested", None)
    read_fd, write_fd = os.pipe()
    os.write(write_fd, bytes([signal.SIGINT]))
    os.close(write_fd)
    interrupts._listen(read_fd)  # returns at the pipe's end
    os.close(read_fd)
    assert said == [(notice(signal.SIGINT), False)]
    assert interrupts.stop_requested()


# The PPO command line under the automatic checkpoint schedule, its saves made 0.3 s slower, as a
# large state's are: after the first chunk's checkpoint no other is due in 12 short chunks. A
# SIGINT to itself as its third chunk ends, which that chunk waits for the listening thread to
# take (else, on a busy host, the stop could land a chunk or two later).
CTRL_C_BETWEEN_AUTOMATIC_CHECKPOINTS = """
import os, signal, sys, time
import purejaxrl_ppo
from utils import checkpoint, driver, interrupts

real_write, real_collect, chunks = checkpoint._write, driver._ChunkRunner.collect, []

def write(path, arrays):
    time.sleep(0.3)
    real_write(path, arrays)

def collect(self, launched):
    out = real_collect(self, launched)
    chunks.append(launched.num_updates)
    if len(chunks) == 3:
        os.kill(os.getpid(), signal.SIGINT)
        while not interrupts.stop_requested():  # the listening thread has taken it
            time.sleep(0.01)
    return out

checkpoint._write, driver._ChunkRunner.collect = write, collect
sys.argv = sys.argv[1:]  # the script and its flags
purejaxrl_ppo.main()
"""


def test_ctrl_c_between_automatic_checkpoints_saves_the_chunk_it_stops_after(tmp_path):
    """A real signal, read by the listening thread: the driver saves the state it stops at
    although the schedule had skipped its checkpoint, and the run resumes from it."""
    flags = command("ppo", "--runs-dir", str(tmp_path), "--keep-checkpoints", "0")
    at = flags.index("--checkpoint-every")
    del flags[at : at + 2]  # the automatic schedule
    result = run_script("-c", CTRL_C_BETWEEN_AUTOMATIC_CHECKPOINTS, *flags)
    assert result.returncode == 130, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert lines[0] == notice(signal.SIGINT) and len(lines) == 2, lines
    assert "interrupted after update 3; continue with --resume " in lines[1], lines
    run_dir = resume_dir(lines[1])
    checkpoints = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
    assert checkpoints == ["update_00000001", "update_00000003"]  # update 2's was not due
    resumed = run_script("purejaxrl_ppo.py", "--resume", run_dir, "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(run_dir, uninterrupted("ppo", tmp_path / "uninterrupted"))
