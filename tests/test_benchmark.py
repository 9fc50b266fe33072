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
