"""The benchmark script keeps working (its numbers are reported, never asserted)."""

import json

from tests.helpers import run_script


def test_throughput_benchmark_runs_with_a_tiny_budget(tmp_path):
    out = tmp_path / "results.json"
    result = run_script(
        "benchmarks/throughput.py",
        "--runs", "ppo:CartPole:1024:--num-envs 8", "dqn:CartPole:20000",
        "--no-progress",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ppo, dqn = json.loads(out.read_text())
    assert (ppo["algo"], ppo["env_id"], ppo["env_steps"]) == ("ppo", "CartPole-v1", 1024)
    assert ppo["num_envs"] == 8 and ppo["extra_flags"] == "--num-envs 8"
    assert (dqn["algo"], dqn["env_id"], dqn["env_steps"]) == ("dqn", "CartPole-v1", 20000)
    for row in (ppo, dqn):
        assert row["train_steps_per_second"] > 0 and row["random_policy_steps_per_second"] > 0
    assert "| ppo | CartPole-v1 | --num-envs 8 |" in result.stdout
    assert "| dqn | CartPole-v1 | preset |" in result.stdout


def test_az_selfplay_benchmark_runs_with_a_tiny_budget(tmp_path):
    out = tmp_path / "results.json"
    result = run_script(
        "benchmarks/az_selfplay.py",
        "--games", "tic_tac_toe:8",
        "--iterations", "2",
        "--rollout-steps", "4",
        "--num-simulations", "4",
        "--extra=--eval-every 2 --eval-episodes 4 --baseline-sims 2 --minibatch-size 8 "
        "--buffer-size 64 --rollout-steps 4 --num-channels 8 --num-blocks 1",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())
    assert (row["game"], row["num_games"]) == ("tic_tac_toe", 8)
    assert row["reference_moves_per_second"] > 0 and row["ours_moves_per_second"] > 0
    assert row["ratio"] > 0
    assert "| tic_tac_toe | 8 | 1 x cpu |" in result.stdout


def test_gpu_benchmark_smoke_mode_runs_on_cpu(tmp_path):
    out = tmp_path / "gpu.json"
    result = run_script("benchmarks/gpu.py", "--smoke", "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["smoke"] and results["backend"] == "cpu"
    assert set(results["runs"]) == {
        "ppo_cartpole_2048_envs",
        "ppo_cartpole_256_seeds",
        "ppo_breakout_minatar_1e7",
        "dqn_cartpole_128_seeds",
        "az_connect_four_1024_games",
    }
    for row in results["runs"].values():
        assert row["per_second_all_seeds"] > 0 and row["compile_seconds"] > 0
    assert results["runs"]["az_connect_four_1024_games"]["unit"] == "moves"


def test_dqn_yardstick_runs_with_a_tiny_budget(tmp_path):
    out = tmp_path / "results.json"
    result = run_script(
        "benchmarks/dqn_yardstick.py",
        "--total-timesteps", "12000",
        "--rounds", "1",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    reference, unrolled, preset, equivalent = json.loads(out.read_text())
    assert reference["ratio_to_reference"] == 1.0
    assert unrolled["setting"] == "PureJaxRL dqn.py loop, unrolled threefry"
    assert equivalent["setting"] == "purejaxrl_dqn.py at PureJaxRL's settings"
    for row in (reference, unrolled, preset, equivalent):
        assert row["steps_per_second"][0] > 0 and row["total_timesteps"] == 12000
    assert "| PureJaxRL dqn.py loop |" in result.stdout
