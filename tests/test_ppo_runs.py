"""PPO through the driver, end to end: the divergence guard and re-evaluation on a real
training state, the CNN torso on MinAtar, memory and normalisation with seeds, sweeps, video,
resume and 2 devices, and 2 devices against 1. (tests/test_ppo.py has the
targets, the loss and the update step; the README's guide copies that file.)"""

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest

import purejaxrl_ppo
from purejaxrl_ppo import PRESETS, Config
from tests.helpers import (
    TINY_PPO,
    assert_identical_runs,
    assert_seed_matches_single_run,
    checkpoint_state,
    interrupt_after_update_4,
    run_script,
)
from utils import driver
from utils.cli import parse_config
from utils.driver import run_training


def test_a_diverging_run_stops_after_its_first_chunk_with_one_line_and_exit_code_3(
    tiny_ppo_args, capsys
):
    """A value-loss weight of 1e38 overflows the first gradient step: the parameters are NaN
    from then on, and so is every loss from update 1. Nothing finite is left to checkpoint."""
    config = parse_config(Config, PRESETS, [*tiny_ppo_args, "--vf-coef", "1e38"])
    with pytest.raises(SystemExit) as exit_info:
        run_training(config, purejaxrl_ppo.make_train, purejaxrl_ppo.validate)
    assert exit_info.value.code == 3
    (run_dir,) = Path(tiny_ppo_args[-1]).iterdir()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"diverged: policy_loss is nan at update 1; no checkpoint before it -> {run_dir}"
    ]
    assert not (run_dir / "checkpoints").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["diverged"] == {"metric": "policy_loss", "update": 1, "seed": 1}
    assert len((run_dir / "metrics.csv").read_text().splitlines()) == 1 + 2  # the first chunk


def test_a_finished_run_is_evaluated_again_when_asked(tiny_ppo_args, capsys):
    """--resume of a finished run with --eval-episodes: the same evaluation again, of the
    checkpoint's state with the same keys, gives the same summary, number for number."""
    make_train, validate = purejaxrl_ppo.make_train, purejaxrl_ppo.validate
    trained = run_training(parse_config(Config, PRESETS, tiny_ppo_args), make_train, validate)
    args = ["--resume", trained["run_dir"], "--eval-episodes", "2"]
    again = run_training(parse_config(Config, PRESETS, args), make_train, validate)
    assert again == trained
    assert "re-evaluated update 8 with --eval-episodes 2: eval return" in capsys.readouterr().out


@pytest.mark.parametrize("sharing", ["--no-shared-torso", "--shared-torso"])
def test_cnn_torso_trains_end_to_end_on_minatar(tmp_path, sharing):
    """The convolution of --torso cnn, in each network or once in the shared torso (Breakout's
    preset)."""
    args = ["--env", "Breakout", "--torso", "cnn", sharing, *TINY_PPO, "--hidden-size", "16"]
    config = parse_config(
        purejaxrl_ppo.Config,
        purejaxrl_ppo.PRESETS,
        [*args, "--eval-episodes", "0", "--no-progress", "--runs-dir", str(tmp_path)],
    )
    summary, state = run_training(
        config, purejaxrl_ppo.make_train, purejaxrl_ppo.validate, return_state=True
    )
    assert {"metrics.csv", "summary.json", "learning_curve.png", "checkpoints"} <= set(
        os.listdir(summary["run_dir"])
    )
    assert summary["env_steps_per_seed"] == 512
    torsos = ("shared",) if config.shared_torso else ("actor", "critic")
    assert set(state.params["params"]) == {"actor", "critic", *torsos}
    for torso in torsos:
        # The first layer is a 3x3 convolution of Breakout's 4 channels into 16, and training
        # moved it: its biases start at 0 (a channel that no observation activates keeps 0).
        conv = state.params["params"][torso]["layers_0"]  # leaves [devices, runs, ...]
        assert conv["kernel"].shape == (1, 1, 3, 3, 4, 16)
        assert np.any(conv["bias"] != 0)


# One PPO configuration trained on 2 devices and, for comparison, on 1; run in a process that
# has 2 fake CPU devices. Prints the largest differences found, as JSON.
TWO_DEVICES_AGAINST_ONE = """
import dataclasses, json
import jax, numpy as np
import purejaxrl_ppo
from utils.devices import DEVICE_AXIS
from utils.trainer import Runtime

def on_devices(tree, num_devices):
    return jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], num_devices, 0), tree)

def start(trainer, num_devices):  # as the driver starts a run: the same key on every device
    init = jax.pmap(trainer.init, axis_name=DEVICE_AXIS)
    return init(*on_devices((jax.random.PRNGKey(0), trainer.hyperparams), num_devices))

def whole_run(trainer):  # compiled once per trainer
    chunk = jax.pmap(lambda s: trainer.train_chunk(s, trainer.num_updates), axis_name=DEVICE_AXIS)
    return lambda state: jax.device_get(chunk(state)[0])

def largest(difference, *trees):
    return float(max(jax.tree.leaves(jax.tree.map(difference, *trees))))

def absolute(a, b):
    return np.abs(a - b).max()

def relative(a, b):  # to the leaf's scale: Adam's moments range over orders of magnitude
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)

def device(tree, index):
    return jax.tree.map(lambda x: x[index], tree)

def across_devices(tree):
    return largest(absolute, device(tree, 0), device(tree, 1))

# max_grad_norm 0: no clipping, which would hide the gradient's size from Adam's moments.
config = purejaxrl_ppo.Config(
    num_envs=4, num_steps=16, num_minibatches=2, update_epochs=2, total_timesteps=512,
    max_grad_norm=0.0,
)
two = purejaxrl_ppo.make_train(config, Runtime(num_devices=2))
# Each device of `two` steps 2 environments: `one` has the same shapes and the same updates.
one = purejaxrl_ppo.make_train(dataclasses.replace(config, num_envs=2, total_timesteps=256))
assert one.num_updates == two.num_updates == 8
start_two = jax.device_get(start(two, 2))
train_two, train_one = whole_run(two), whole_run(one)
end_two = train_two(start_two)
# Device 1 given device 0's environments and keys: both devices compute the same gradients, and
# `one` starts from device 0's state.
same_data = jax.tree.map(lambda x: np.repeat(x[:1], 2, 0), start_two)
end_same_data, end_one = train_two(same_data), train_one(jax.tree.map(lambda x: x[:1], start_two))
same, alone = device(end_same_data, 0), device(end_one, 0)
print(json.dumps({
    "envs_per_device": start_two.obs.shape[1],
    "start_params_across_devices": across_devices(start_two.params),
    "start_obs_across_devices": across_devices(start_two.obs),
    "end_params_across_devices": across_devices(end_two.params),
    "params_against_one": largest(absolute, same.params, alone.params),
    "adam_against_one": largest(relative, same.opt_state, alone.opt_state),
}))
"""


def test_two_devices_train_one_agent_with_averaged_gradients():
    """What the device layout keeps equal (docs/ppo.md, "Devices"). Each device steps its share
    of the environments with its own keys: the device index is folded into the environment key,
    so a 2-device run collects other episodes than a 1-device run, by design. The network starts
    the same on both devices and stays identical. Given the same environments and
    keys on both devices, the mean of their two equal gradients is that gradient exactly, so the
    run equals a 1-device run of half the environments up to the rounding of differently
    compiled programs; summed gradients would double Adam's first moment and quadruple its
    second."""
    result = run_script("-c", TWO_DEVICES_AGAINST_ONE, devices=2)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["envs_per_device"] == 2
    assert found["start_params_across_devices"] == 0 and found["start_obs_across_devices"] > 0
    assert found["end_params_across_devices"] == 0
    # Equal on the recording machine; the bounds leave room for another processor's rounding
    # and are far below what summed gradients give: 4e-4 and 3 (Adam's second moment x 4).
    assert found["params_against_one"] < 1e-5, found
    assert found["adam_against_one"] < 1e-3, found


# ---------------------------------------------------------------------------------------------
# Memory and normalisation through the driver
# ---------------------------------------------------------------------------------------------

MEMORY_AND_NORMALISATION = ["--memory", "gru", "--hidden-size", "16", "--normalize-obs",
                            "--normalize-reward"]  # fmt: skip


def train_ppo(tiny_ppo_args, *flags):
    config = parse_config(Config, PRESETS, [*tiny_ppo_args, *MEMORY_AND_NORMALISATION, *flags])
    return run_training(config, purejaxrl_ppo.make_train, purejaxrl_ppo.validate)


def test_memory_and_normalisation_resume_exactly_and_batch_seeds_and_sweeps(
    tiny_ppo_args, monkeypatch
):
    """A run with --memory gru and both normalisations stopped after update 4 and resumed
    equals the run that was never stopped, bit for bit: the GRU's memory, the statistics and
    the discounted returns are in the checkpoint. Run 3 of 2 seeds x 2 gammas, trained side by
    side with a video of the greedy policy, equals the single run with its seed and gamma."""
    alone = train_ppo(tiny_ppo_args, "--seed", "2", "--gamma", "0.9")

    with monkeypatch.context() as patch:
        patch.setattr(driver._Progress, "update", interrupt_after_update_4)
        with pytest.raises(SystemExit):  # a checkpoint after every chunk: update 4's is there
            train_ppo(tiny_ppo_args, "--seed", "2", "--gamma", "0.9", "--checkpoint-every", "1")
    (interrupted,) = {str(d) for d in Path(tiny_ppo_args[-1]).iterdir()} - {alone["run_dir"]}
    resumed = run_training(
        parse_config(Config, PRESETS, ["--resume", interrupted, "--no-progress"]),
        purejaxrl_ppo.make_train,
        purejaxrl_ppo.validate,
    )
    assert resumed["resumed_from_update"] == 4
    assert_identical_runs(alone["run_dir"], interrupted)
    state = checkpoint_state(purejaxrl_ppo, interrupted)
    assert state.memory.shape == (1, 1, 4, 16) and np.abs(state.memory).max() > 0
    assert state.normalizer.obs.count[0, 0] == 1e-4 + 4 * (8 * 16 + 1)

    together = train_ppo(
        tiny_ppo_args, "--num-seeds", "2", "--sweep", "gamma=0.99,0.9", "--capture-video"
    )
    assert_seed_matches_single_run(together, 3, alone)
    assert os.path.isfile(os.path.join(together["run_dir"], "videos", "final.gif"))


def test_memory_and_normalisation_on_two_devices_share_parameters_and_statistics(tmp_path):
    """Each device steps its own environments, so each keeps its own memory and discounted
    returns; the statistics are merged over both devices and stay the same on each, as the
    parameters do."""
    result = run_script(
        "purejaxrl_ppo.py", "--env", "CartPole", *TINY_PPO, *MEMORY_AND_NORMALISATION,
        "--num-devices", "2", "--no-progress", "--runs-dir", str(tmp_path), devices=2,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = tmp_path.iterdir()
    state = checkpoint_state(purejaxrl_ppo, run_dir)  # leaves [devices, runs, ...]
    shared = (state.params, state.normalizer.obs, state.normalizer.returns)
    for leaf in jax.tree.leaves(shared):
        np.testing.assert_array_equal(leaf[0], leaf[1])
    for leaf in (state.memory, state.normalizer.discounted_return):
        assert leaf.shape[2] == 2 and not np.array_equal(leaf[0], leaf[1])
    assert state.normalizer.obs.count[0, 0] == 1e-4 + 4 * (8 * 16 + 1)
