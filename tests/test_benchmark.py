"""The benchmark scripts keep working (their numbers are reported, never asserted).

Some run in pairs, one after the other, in one test: the GPU smoke run and the AlphaZero
self-play benchmark share their program sizes, so the second reads its compilations from the
session's JAX cache. The yardstick and time_to_skill compile every run from scratch, as they
measure compile times."""

import json

from benchmarks import references, time_to_skill
from benchmarks.yardstick import WORKLOADS, ours_config
from tests.helpers import run_script


def check_throughput_benchmark(tmp_path):
    out = tmp_path / "results.json"
    result = run_script(
        "benchmarks/throughput.py",
        "--runs", "ppo:CartPole:1024:--num-envs 8", "dqn:CartPole:12000",
        "--no-progress",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    ppo, dqn = json.loads(out.read_text())
    assert (ppo["algo"], ppo["env_id"], ppo["env_steps"]) == ("ppo", "CartPole-v1", 1024)
    assert ppo["num_envs"] == 8 and ppo["extra_flags"] == "--num-envs 8"
    assert (dqn["algo"], dqn["env_id"], dqn["env_steps"]) == ("dqn", "CartPole-v1", 12000)
    for row in (ppo, dqn):
        assert row["train_steps_per_second"] > 0 and row["random_policy_steps_per_second"] > 0
    assert "| ppo | CartPole-v1 | --num-envs 8 |" in result.stdout
    assert "| dqn | CartPole-v1 | preset |" in result.stdout


def check_az_selfplay_benchmark(tmp_path):
    out = tmp_path / "results.json"
    # The sizes of benchmarks/gpu.py's --smoke AlphaZero run.
    result = run_script(
        "benchmarks/az_selfplay.py",
        "--games", "connect_four:16",
        "--iterations", "4",
        "--rollout-steps", "4",
        "--num-simulations", "4",
        "--rounds", "2",
        "--extra=--rollout-steps 4 --buffer-size 256 --minibatch-size 16 --eval-every 2 "
        "--eval-games 4 --baseline-sims 2 --num-channels 8 --num-blocks 1",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(out.read_text())
    assert (row["game"], row["num_games"]) == ("connect_four", 16)
    sides = ("reference", "whole_iteration", "ours")
    rounds = [row[f"{side}_moves_per_second"] for side in sides]
    assert [len(r) for r in rounds] == [2, 2, 2] and min(min(r) for r in rounds) > 0
    assert len(row["ours_whole_run_moves_per_second"]) == 2
    assert min(row[f"{side}_compile_seconds"] for side in sides) > 0
    assert row["ratio"] > 0 and row["ratio_to_whole_iteration"] > 0
    assert "| connect_four | 16 | 1 x cpu |" in result.stdout


def check_gpu_benchmark_smoke_mode(tmp_path):
    out = tmp_path / "gpu.json"
    # The Craftax and Brax runs compile for minutes on a CPU: their flags are checked by
    # test_every_gpu_benchmark_run_parses_and_validates instead.
    # time_to_skill and the yardstick have smoke tests of their own. The seeds and MinAtar runs
    # are the same trainers with other flags, which the dry run checks: the suite's time goes
    # elsewhere.
    heavy = [
        "ppo_craftax_classic_1024_envs",
        "ppo_hopper_2048_envs",
        "time_to_skill",
        "yardstick",
        "ppo_cartpole_256_seeds",
        "ppo_breakout_minatar_1e7",
        "dqn_cartpole_128_seeds",
    ]
    result = run_script(
        "benchmarks/gpu.py", "--smoke", "--out", str(out), "--skip", *heavy, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["smoke"] and results["backend"] == "cpu"
    assert set(results["runs"]) == {"ppo_cartpole_2048_envs", "az_connect_four_1024_games"}
    for row in results["runs"].values():
        assert row["per_second_all_seeds"] > 0 and row["compile_seconds"] > 0
    assert results["runs"]["az_connect_four_1024_games"]["unit"] == "moves"


def check_yardstick(tmp_path):
    out = tmp_path / "yardstick.json"
    result = run_script(
        "benchmarks/yardstick.py",
        "--workloads", "ppo_cartpole,dqn_cartpole",
        "--total-timesteps", "12000",
        "--rounds", "1",
        "--no-progress",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert [(r["workload"], r["setting"]) for r in rows] == [
        ("ppo_cartpole", "PureJaxRL ppo.py loop"),
        ("ppo_cartpole", "ours at its settings"),
        ("dqn_cartpole", "PureJaxRL dqn.py loop"),
        ("dqn_cartpole", "ours at its settings"),
    ]
    for row in rows:
        assert row["steps_per_second"][0] > 0 and row["compile_seconds"][0] > 0
        assert row["total_timesteps"] == 12000
    assert rows[0]["throughput_ratio"] == rows[0]["compile_ratio"] == 1.0
    assert "| dqn_cartpole | PureJaxRL dqn.py loop |" in result.stdout


def test_yardstick_runs_ours_at_each_anchors_settings():
    def ours(name):  # the config the yardstick trains
        workload = WORKLOADS[name]
        return ours_config(workload, workload.total_timesteps, workload.flags)

    for name, settings in (
        ("ppo_cartpole", references.PPO_CARTPOLE),
        ("ppo_breakout", references.PPO_MINATAR),
    ):
        config = ours(name)
        for field, value in settings._asdict().items():
            if field != "total_timesteps":  # the workload's own
                assert getattr(config, "clip_coef" if field == "clip_eps" else field) == value
        assert (config.hidden_size, config.torso, config.anneal_lr) == (64, "mlp", True)
        assert not config.shared_torso  # two networks, as PureJaxRL's
        assert config.clip_vloss and config.norm_adv and not config.normalize_obs
    config = ours("dqn_cartpole")
    assert config.num_envs == references.DQN_NUM_ENVS
    assert config.learning_rate == references.DQN_LEARNING_RATE
    assert (config.buffer_size, config.batch_size) == (
        references.DQN_BUFFER_SIZE,
        references.DQN_BATCH_SIZE,
    )
    assert config.learning_starts == references.DQN_LEARNING_STARTS
    assert config.target_network_frequency == references.DQN_TARGET_UPDATE_INTERVAL
    anneal_steps = config.exploration_fraction * WORKLOADS["dqn_cartpole"].total_timesteps
    assert anneal_steps == references.DQN_EPSILON_ANNEAL_TIME
    assert (config.start_e, config.end_e, config.gamma) == (1.0, 0.05, references.DQN_GAMMA)
    assert (config.train_frequency, config.gradient_steps, config.n_step) == (1, 1, 1)
    assert config.hidden_sizes == (120, 84) and not config.double_dqn
    assert config.max_grad_norm == 0 and config.loss == "mse" and not config.dueling


def test_yardstick_rejects_an_unknown_workload():
    result = run_script("benchmarks/yardstick.py", "--workloads", "ppo_pong")
    assert result.returncode == 2
    assert "unknown workloads ['ppo_pong']" in result.stderr


def test_gpu_smoke_then_az_selfplay_benchmarks_run(tmp_path):
    check_gpu_benchmark_smoke_mode(tmp_path)
    check_az_selfplay_benchmark(tmp_path)


def test_throughput_then_yardstick_benchmarks_run(tmp_path):
    check_throughput_benchmark(tmp_path)
    check_yardstick(tmp_path)


def test_every_gpu_benchmark_run_parses_and_validates():
    result = run_script("benchmarks/gpu.py", "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("flags parse and validate") == 7 + 5 + 3
    for name in time_to_skill.WORKLOADS:  # every one, the default
        assert f"time_to_skill {name}: flags parse and validate" in result.stdout
    for name in ("ppo_cartpole", "ppo_breakout", "dqn_cartpole"):
        assert f"yardstick {name}: flags parse and validate" in result.stdout


def test_gpu_benchmark_rejects_zero_seeds_or_rounds():
    for flag in ("--skill-seeds", "--yardstick-rounds"):
        result = run_script("benchmarks/gpu.py", "--dry-run", flag, "0")
        assert result.returncode == 2
        assert f"error: {flag} must be at least 1, got 0." in result.stderr
        assert "flags parse and validate" not in result.stdout


def test_time_to_skill_benchmark_runs(tmp_path):
    # Alone, not in a pair: the benchmark compiles every run from scratch, without the cache.
    # A threshold any run meets at its first chunk (an AlphaZero loss rate of at most 1 too).
    out = tmp_path / "skill.json"
    result = run_script(
        "benchmarks/time_to_skill.py",
        "--workloads", "ppo_cartpole,az_tic_tac_toe",
        "--smoke",
        "--threshold", "1",
        "--seeds", "1",
        "--cpu-devices", "0",
        "--out", str(out),
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["seeds"] == 1 and results["smoke"]
    ppo, az = results["workloads"]
    assert (ppo["workload"], az["workload"]) == ("ppo_cartpole", "az_tic_tac_toe")
    for row in (ppo, az):
        for side in ("ours", "anchor"):
            stats = row[side]
            assert (stats["reached"], stats["seeds"]) == (1, 1)
            assert [run["seed"] for run in row["runs"][side]] == [1]
            for field in ("wall_seconds", "train_seconds", "steps"):
                assert stats[field]["min"] <= stats[field]["median"] <= stats[field]["max"]
                assert not stats[field]["lower_bound"]
        assert float(row["ratio_wall"]) > 0 and float(row["ratio_train"]) >= 0
    assert ppo["ours"]["steps"]["median"] == 64  # one update of 4 envs x 16 steps
    assert "ppo CartPole-v1: stopped at update 1 of 32," in result.stdout  # not trained on
    assert az["anchor"]["steps"]["median"] == 64  # one iteration of 16 games x 4 moves
    lines = results["table"].splitlines()
    assert lines[0].startswith("| workload | goal | anchor |") and len(lines) == 4
    assert lines[2].startswith(
        "| ppo_cartpole | episode_return 1.0 | PureJaxRL ppo.py | 1/1 / 1/1 |"
    )
    assert results["table"] in result.stdout
