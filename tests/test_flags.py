"""Property-based: random values, random types and random combinations of every trainer's
flags, --sweep included. Whatever the command line holds, planning the run ends in a valid run
configuration, a ConfigError of one sentence or tyro's usage error (exit code 2), never in
another exception, and a refused command line writes nothing and leaves the process's
environment as it was. In process and without training: `parse_config`, then the driver's
`plan_runs`, which makes every check before it creates the run directory and compiles
nothing."""

import contextlib
import dataclasses
import io
import json
import os
import typing
import warnings

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import purejaxrl_az
import purejaxrl_dqn
import purejaxrl_ppo
from utils.cli import parse_config
from utils.driver import plan_runs
from utils.errors import ConfigError

TRAINERS = {
    "ppo": (purejaxrl_ppo, {}, ["CartPole", "Acrobot-v1", "Pendulum", "Breakout", "Catch"]),
    "dqn": (purejaxrl_dqn, {}, ["CartPole", "MountainCar", "Pendulum", "Freeway-MinAtar"]),
    "az": (
        purejaxrl_az,
        {"preset_key": purejaxrl_az.resolve_game},
        ["tic_tac_toe", "Connect-Four", "hex", "animal_shogi", "2048"],
    ),
}
# A fixed sequence of examples, so that CI sees the same command lines on every run, and no
# example database written into the repository. AlphaZero's trainer takes about a second to
# plan, the others a tenth.
EXAMPLES = {"ppo": 200, "dqn": 200, "az": 40}

INTS = st.integers(-3, 300).map(str) | st.sampled_from(
    ["4096", "65536", str(2**31 - 1), str(2**31), str(10**12), str(2**63), "-2147483648"]
)
FLOATS = st.floats().map(repr) | st.sampled_from(["nan", "-inf", "1e-3", "-0.0", "1e400", "1"])
TEXT = st.text(alphabet="abcxyz019.,=-_ ", max_size=8)
# Paths the test makes in its folder: the runs dir, a file, a saved run of this trainer and
# one of another trainer.
PATHS = st.sampled_from(["runs", "runs/nested", "file", "saved", "other", "missing"])


def sweep_specs(hyperparams: tuple[str, ...]):
    names = st.sampled_from([*hyperparams, "lr", "ent-coef", "num_envs", "seed", "sweep"]) | TEXT
    values = st.lists(INTS | FLOATS | TEXT, max_size=3).map(",".join) | st.sampled_from([",", " "])
    spec = st.tuples(names, st.sampled_from(["=", "", "=="]), values).map("".join)
    return st.lists(spec, max_size=3)


def values_of(name: str, kind, module, envs):
    """Value tokens for the flag of the field `name` with type `kind`."""
    if name == "env":
        own = st.sampled_from(envs)
    elif name in ("runs_dir", "resume"):
        own = PATHS
    elif name == "sweep":
        return sweep_specs(module.HyperParams._fields)
    elif typing.get_origin(kind) is typing.Literal:
        own = st.sampled_from(typing.get_args(kind))
    elif typing.get_origin(kind) is tuple:
        return st.lists(INTS, max_size=3)
    elif int in (kind, *typing.get_args(kind)):
        own = INTS
    elif kind is float:
        own = FLOATS
    else:
        own = TEXT
    # now and then a value of another type
    return st.one_of(*[own] * 7, INTS | FLOATS | TEXT).map(lambda value: [value])


@st.composite
def command_lines(draw, module, envs):
    """Flags of random fields in random order, with random values, and now and then a stray
    token; PATHS values are names in the test's folder."""
    hints = typing.get_type_hints(module.Config)
    args = []
    for name in draw(st.lists(st.sampled_from(sorted(hints)), max_size=6, unique=True)):
        flag = name.replace("_", "-")
        if hints[name] is bool:
            args.append(draw(st.sampled_from([f"--{flag}", f"--no-{flag}"])))
        else:
            args += [
                f"--{draw(st.sampled_from([flag, name]))}",
                *draw(values_of(name, hints[name], module, envs)),
            ]
    if draw(st.integers(0, 9)) == 0:
        args.insert(draw(st.integers(0, len(args))), draw(TEXT))
    return args


def make_folder(root, module):
    """The test's folder: a file, a saved run of `module` and one of another trainer."""
    (root / "file").write_text("not a directory")
    other, algo = (purejaxrl_dqn, "dqn") if module is purejaxrl_ppo else (purejaxrl_ppo, "ppo")
    for name, saved in (("saved", module), ("other", other)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(dataclasses.asdict(saved.Config())))
    (root / "other" / "run.json").write_text(json.dumps({"algo": algo}))


def files_under(root) -> set[str]:
    return {
        os.path.join(path, name) for path, dirs, files in os.walk(root) for name in dirs + files
    }


class Restart(Exception):
    """What the test's os.execv raises: the process would restart itself to apply the flags."""


def plan(module, kwargs, args):
    """'valid', 'refused' (a ConfigError of one sentence) or 'usage' (tyro's exit code 2). A
    RuntimeWarning (a value overflowing as it is cast for the compiled program) raises."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            config = parse_config(module.Config, module.PRESETS, args, **kwargs)
            plan_runs(config, module.make_train, module.validate)
    except SystemExit as exit:
        assert exit.code == 2 and stderr.getvalue().strip(), (exit.code, stderr.getvalue())
        return "usage"
    except ConfigError as error:
        assert str(error).strip() and "\n" not in str(error), repr(str(error))
        return "refused"
    except Restart:
        pass  # valid: the process would go on after restarting
    return "valid"


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_any_command_line_is_a_valid_run_or_one_sentence(name, tmp_path_factory, monkeypatch):
    module, kwargs, envs = TRAINERS[name]

    def restart(*_):
        raise Restart

    # A CPU split or --distributed restarts the process (utils.devices.split_cpu_host).
    monkeypatch.setattr(os, "execv", restart)

    # Command lines that failed once, every trainer's flag among them (another trainer's is
    # tyro's usage error): always tried first.
    @given(command_lines(module, envs))
    @example(["--sweep", "learning_rate=,"])  # an IndexError
    @example(["--hidden-size", "2147483648"])  # OverflowError
    @example(["--num-channels", "2147483648"])  # OverflowError
    @example(["--target-network-frequency", "2147483648"])  # OverflowError
    @example(["--max-grad-norm", "1e300"])  # float32 overflow
    @example(["--weight-decay", "1e300"])  # float32 overflow
    @example(["--distributed"])  # the environment changed
    @example(["--total-timesteps", str(10**13)])  # planning took hours
    @settings(max_examples=EXAMPLES[name], deadline=None, derandomize=True, database=None)
    def check(args):
        root = tmp_path_factory.mktemp(name)
        make_folder(root, module)
        before, environment = files_under(root), dict(os.environ)
        with contextlib.chdir(root):  # every path on the command line is in the test's folder
            try:
                outcome = plan(module, kwargs, args)
            finally:  # a restart would have set up the new process's environment
                changed = dict(os.environ) != environment
                os.environ.clear()
                os.environ.update(environment)
        if outcome != "valid":
            assert files_under(root) == before, f"{outcome}, yet files were written"
            assert not changed, f"{outcome}, yet the environment changed"

    # The first command line imports gymnax, whose pygame sets PYGAME_HIDE_SUPPORT_PROMPT.
    plan(module, kwargs, ["--seed", "one"])
    check()
