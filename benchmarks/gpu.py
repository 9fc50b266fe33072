"""The accelerator benchmark: seven runs that show what one GPU does, the time-to-skill table
and the throughput table at the anchors' settings, in one JSON file.

    python benchmarks/gpu.py --out gpu.json             # on a GPU or TPU machine
    python benchmarks/gpu.py --smoke --out smoke.json   # the same runs, tiny, on any CPU
    python benchmarks/gpu.py --dry-run                  # parse and check every run's flags only

Runs, each through the normal driver (metrics.csv and checkpoints as in a user's run, no
progress bar, no final evaluation): PPO CartPole with 2048 envs; PPO CartPole with 256 vmapped
seeds; PPO Breakout-MinAtar for 1e7 steps at its preset; PPO Craftax-Classic with the Craftax
paper's 1024 envs; PPO on Brax's hopper with PureJaxRL's 2048 envs x 10 steps; DQN CartPole
with 128 seeds; AlphaZero connect_four with 1024 games. Each row has steps (or moves) per
second over all seeds, compile seconds and wall seconds. Then benchmarks/time_to_skill.py's
default workloads, 3 seeds each (--skill-seeds; 1 with --smoke), ours next to the anchors: its
table goes into the JSON file as "time_to_skill" (leave it out with --skip time_to_skill). Last,
benchmarks/yardstick.py's workloads, 2 rounds (--yardstick-rounds; 1 of tiny runs with --smoke):
its rows go in as "yardstick" (--skip yardstick). docs/benchmarks.md ("GPU") says how long
each part took on one GPU, for sizing a run to the time a machine is available.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import tempfile
import time

import jax
import tyro

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import purejaxrl_az
import purejaxrl_dqn
import purejaxrl_ppo
from benchmarks import time_to_skill, yardstick
from utils.cli import parse_config
from utils.driver import run_training
from utils.logs import write_json
from utils.trainer import Runtime


@dataclasses.dataclass
class Args:
    smoke: bool = False
    """tiny sizes, so that the script can be checked on a CPU in about a minute"""
    out: str = "gpu_benchmark.json"
    """where the JSON results go"""
    skip: tuple[str, ...] = ()
    """names of runs to leave out (time_to_skill: the time-to-skill table; yardstick: the
    throughput table at the anchors' settings)"""
    skill_seeds: int = 3
    """seeds per side of each time-to-skill workload (1 with --smoke)"""
    yardstick_rounds: int = 2
    """rounds of the yardstick's table (1 with --smoke)"""
    dry_run: bool = False
    """parse and validate every run's flags, at full and smoke size, and train nothing"""


# name -> (trainer, flags at full size, flags in --smoke mode)
RUNS = {
    "ppo_cartpole_2048_envs": (
        purejaxrl_ppo,
        "--env CartPole --num-envs 2048 --num-steps 16 --num-minibatches 4 "
        "--total-timesteps 20000000",
        "--env CartPole --num-envs 16 --num-steps 16 --num-minibatches 4 --total-timesteps 2048",
    ),
    "ppo_cartpole_256_seeds": (
        purejaxrl_ppo,
        "--env CartPole --num-seeds 256 --total-timesteps 500000",
        "--env CartPole --num-seeds 4 --num-envs 4 --num-steps 16 --total-timesteps 1024",
    ),
    "ppo_breakout_minatar_1e7": (
        purejaxrl_ppo,
        "--env Breakout --total-timesteps 10000000",
        "--env Breakout --num-envs 8 --num-steps 16 --total-timesteps 2048",
    ),
    "ppo_craftax_classic_1024_envs": (
        purejaxrl_ppo,
        "--env Craftax-Classic --num-envs 1024 --total-timesteps 20000000",
        "--env Craftax-Classic --num-envs 4 --num-steps 16 --num-minibatches 2 "
        "--total-timesteps 128",
    ),
    "ppo_hopper_2048_envs": (
        purejaxrl_ppo,
        "--env Hopper --num-envs 2048 --num-steps 10 --num-minibatches 32 "
        "--total-timesteps 20000000",
        "--env Hopper --num-envs 4 --num-steps 16 --num-minibatches 2 --total-timesteps 128",
    ),
    "dqn_cartpole_128_seeds": (
        purejaxrl_dqn,
        "--env CartPole --num-seeds 128 --total-timesteps 500000",
        "--env CartPole --num-seeds 4 --total-timesteps 2000 --learning-starts 500 "
        "--buffer-size 1000",
    ),
    "az_connect_four_1024_games": (
        purejaxrl_az,
        "--env connect_four --num-games 1024 --rollout-steps 32 --buffer-size 262144 "
        "--num-iterations 20 --minibatch-size 2048 --eval-every 20",
        "--env connect_four --num-games 16 --rollout-steps 4 --buffer-size 256 "
        "--num-iterations 2 --minibatch-size 16 --eval-every 2 --eval-games 4 "
        "--num-simulations 4 --baseline-sims 2 --num-channels 8 --num-blocks 1",
    ),
}


def parse_run(trainer, flags: str, runs_dir: str, smoke: bool):
    """The config of one run, through the trainers' command-line parsing."""
    cli = [*flags.split(), "--runs-dir", runs_dir, "--no-progress"]
    if trainer is purejaxrl_az:  # evaluates inside its loop, on the devices it finds
        cli += ["--eval-games", "4" if smoke else "64", "--cpu-devices", "0"]
        return parse_config(trainer.Config, trainer.PRESETS, cli, preset_key=trainer.resolve_game)
    cli += ["--eval-episodes", "0"]
    return parse_config(trainer.Config, trainer.PRESETS, cli)


def dry_run() -> None:
    """Every run's flags, at both sizes, parsed and validated as the driver would; so are our
    side's flags of the time-to-skill and yardstick workloads."""
    for name, (trainer, full, smoke) in RUNS.items():
        for size, flags in (("full", full), ("smoke", smoke)):
            config = parse_run(trainer, flags, "runs", size == "smoke")
            trainer.validate(config, Runtime())
        print(f"{name}: flags parse and validate")
    for name in time_to_skill.DEFAULT_WORKLOADS.split(","):
        workload = time_to_skill.WORKLOADS[name]
        for flags in (workload.flags, workload.smoke_flags):
            config = parse_run(workload.trainer, flags, "runs", flags == workload.smoke_flags)
            workload.trainer.validate(config, Runtime())
        print(f"time_to_skill {name}: flags parse and validate")
    for name, workload in yardstick.WORKLOADS.items():
        config = yardstick.ours_config(workload, workload.total_timesteps, workload.flags)
        workload.trainer.validate(config, Runtime())
        print(f"yardstick {name}: flags parse and validate")


def main(args: Args) -> dict:
    for flag, value in (
        ("--skill-seeds", args.skill_seeds),
        ("--yardstick-rounds", args.yardstick_rounds),
    ):
        if value < 1:
            print(f"error: {flag} must be at least 1, got {value}.", file=sys.stderr)
            raise SystemExit(2)
    if args.dry_run:
        dry_run()
        return {}
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "devices": [str(d.device_kind) for d in jax.devices()],
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "smoke": args.smoke,
        "runs": {},
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as runs_dir:
        for name, (trainer, full, smoke) in RUNS.items():
            if name in args.skip:
                continue
            flags = smoke if args.smoke else full
            config = parse_run(trainer, flags, runs_dir, args.smoke)
            summary = run_training(config, trainer.make_train, trainer.validate)
            results["runs"][name] = {
                "flags": flags,
                "unit": summary["step_unit"],
                "per_second_all_seeds": round(summary["steps_per_second"]),
                "compile_seconds": round(summary["compile_seconds"], 2),
                "wall_seconds": round(summary["wall_seconds"], 2),
                "final": summary["final_mean"],
            }
            write_json(args.out, results)  # a run cut short keeps the rows before it
            row = results["runs"][name]
            print(
                f"{name}: {row['per_second_all_seeds']:,} {row['unit']}/s, "
                f"compile {row['compile_seconds']} s, wall {row['wall_seconds']} s",
                flush=True,
            )
    if "time_to_skill" not in args.skip:  # last: it turns the compilation cache off
        skill = time_to_skill.main(
            time_to_skill.Args(
                seeds=1 if args.smoke else args.skill_seeds, cpu_devices=0, smoke=args.smoke
            )
        )
        results["time_to_skill"] = {k: skill[k] for k in ("seeds", "workloads", "table")}
    if "yardstick" not in args.skip:  # it too compiles without the cache
        results["yardstick"] = yardstick.main(
            yardstick.Args(
                rounds=1 if args.smoke else args.yardstick_rounds,
                total_timesteps=12_000 if args.smoke else None,
                progress=False,
            )
        )
    results["total_seconds"] = round(time.perf_counter() - start, 1)
    write_json(args.out, results)
    return results


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
