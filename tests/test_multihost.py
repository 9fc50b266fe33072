"""Multi-process training on JAX's own runtime: two local CPU processes with one device each
(gloo collectives over 127.0.0.1) against one process with two devices. One device per process
also checks that the cross-device averages span the processes: locally there is nothing to
average."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from purejaxrl_ppo import Config
from tests.helpers import REPO, checkpoint_leaves, metric_table, run_script
from utils import checkpoint
from utils.devices import process_group, xla_flags_with_cpu_devices
from utils.errors import ConfigError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_like_one_process_with_two_devices(tiny_ppo_args, tmp_path):
    """Its 8 updates in chunks of 3, 3 and 2: the last runs the others' program, told how many
    of its updates to run, in every process."""
    tiny_ppo_args = [*tiny_ppo_args[:-2], "--updates-per-chunk", "3", *tiny_ppo_args[-2:]]
    group = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    flags = [*tiny_ppo_args, "--cpu-devices", "1", *group]
    # One CPU device per process, at the session's LLVM level like the one-process run below.
    env = {**os.environ, "XLA_FLAGS": xla_flags_with_cpu_devices(1)}
    # Process 0 is the command line itself; process 1 also hands back its parameters.
    commands = [
        [sys.executable, "purejaxrl_ppo.py", *flags, "--process-id", "0"],
        [
            sys.executable,
            "tests/multihost_worker.py",
            str(tmp_path / "process_1.npz"),
            *flags,
            "--process-id",
            "1",
        ],
    ]
    processes = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for c in commands
    ]
    outputs = []
    try:
        for p in processes:
            stdout, stderr = p.communicate(timeout=300)
            outputs.append(stdout.decode())
            assert p.returncode == 0, stderr.decode()[-3000:]
    finally:
        for p in processes:
            p.kill()  # SIGKILL: a process waiting on a lost peer ignores SIGTERM
    assert "process 1 of 2 done" in outputs[1]

    runs_dir = tiny_ppo_args[-1]
    (two_processes,) = (entry.path for entry in os.scandir(runs_dir))  # process 0 alone wrote
    with open(os.path.join(two_processes, "summary.json")) as f:
        summary = json.load(f)
    assert summary["num_devices"] == 2 and summary["num_processes"] == 2
    assert [end["update"] for end in summary["chunk_ends"]] == [3, 6, 8]

    result = run_script(
        "purejaxrl_ppo.py", *tiny_ppo_args[:-1], str(tmp_path / "single"), "--cpu-devices", "2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (one_process,) = (entry.path for entry in os.scandir(tmp_path / "single"))

    # Same parameters in both processes, and the same as one process with two devices: the
    # checkpoint holds process 0's device (leaves [devices, runs, ...], params first).
    process_1 = np.load(tmp_path / "process_1.npz")
    process_0, single = checkpoint_leaves(two_processes), checkpoint_leaves(one_process)
    for i in range(len(process_1.files)):
        leaf = f"{i:05d}"
        np.testing.assert_array_equal(process_0[leaf][0, 0], process_1[f"arr_{i}"])
        np.testing.assert_allclose(process_0[leaf][0], single[leaf][0], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        metric_table(two_processes, 0), metric_table(one_process, 0), rtol=1e-4, atol=1e-6
    )


def test_sigterm_to_one_process_stops_every_process_after_the_same_update(tiny_ppo_args):
    """SIGTERM stays with JAX's preemption notifier in a process group: the processes agree on
    an update, each stops after it with exit code 130, and none waits for a lost peer."""
    group = ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
    flags = [*tiny_ppo_args, "--cpu-devices", "1", *group]
    flags += ["--total-timesteps", "1000000", "--updates-per-chunk", "1", "--eval-episodes", "0"]
    env = {**os.environ, "XLA_FLAGS": xla_flags_with_cpu_devices(1)}
    processes = [
        subprocess.Popen(
            [sys.executable, "purejaxrl_ppo.py", *flags, "--process-id", str(i)],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    runs_dir = Path(tiny_ppo_args[-1])
    try:
        deadline = time.monotonic() + 240
        while not list(runs_dir.glob("*/checkpoints/update_*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        processes[1].send_signal(signal.SIGTERM)
        errors = [p.communicate(timeout=120)[1] for p in processes]
    finally:
        for p in processes:
            p.kill()
    for p, stderr in zip(processes, errors, strict=True):
        assert p.returncode == 130, stderr[-3000:]
        assert "Traceback" not in stderr, stderr[-3000:]
    # Process 0 names the update its checkpoint holds; process 1 cannot see that directory.
    (stopped,) = re.findall(r"interrupted after update (\d+)", errors[0])
    assert errors[1].strip().endswith("interrupted"), errors[1][-3000:]
    (run_dir,) = runs_dir.iterdir()
    assert checkpoint.latest_update(str(run_dir / "checkpoints")) == int(stopped)


def test_process_group_comes_from_flags_then_the_environment(monkeypatch):
    assert process_group(Config()) is None  # one process unless asked
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    assert process_group(Config(distributed=True)) == {
        "coordinator_address": None,  # JAX reads JAX_COORDINATOR_ADDRESS or the cluster's
        "num_processes": 4,
        "process_id": 3,
    }
    assert process_group(Config(coordinator_address="h:1", process_id=1)) == {
        "coordinator_address": "h:1",
        "num_processes": 4,
        "process_id": 1,
    }
    with pytest.raises(ConfigError, match=r"--process-id 5 is not in \[0, 2\)"):
        process_group(Config(num_processes=2, process_id=5))
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES must be an integer"):
        process_group(Config(distributed=True))
