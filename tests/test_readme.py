"""The documented commands keep working: the README's Run examples and docs/multi-host.md's
commands parse and build (no compile), and the README's "Make it yours" guide, followed step by
step on a copy of the repository, trains and tests."""

import importlib
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import purejaxrl_az
import purejaxrl_ppo
from tests.helpers import REPO, run_script
from utils.cli import parse_config
from utils.devices import process_group
from utils.sweep import sweep_configs
from utils.trainer import Runtime


def section(title: str, document: str = "README.md") -> str:
    """The `## title` section of a Markdown file of the repository, up to the next `## `."""
    text = (REPO / document).read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def code_blocks(text: str, language: str | None = None) -> list[str]:
    blocks = re.findall(r"```(\w*)\n(.*?)```", text, re.S)
    return [body for lang, body in blocks if language is None or lang == language]


def commands(text: str, program: str) -> list[list[str]]:
    """Command lines that start with `program`, without their trailing comments."""
    found = []
    for block in code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(program):
                found.append(shlex.split(line, comments=True))
    return found


RUN_COMMANDS = commands(section("Run"), "python purejaxrl_")


def test_the_run_section_has_commands_for_every_trainer():
    scripts = {argv[1] for argv in RUN_COMMANDS}
    assert scripts == {"purejaxrl_ppo.py", "purejaxrl_dqn.py", "purejaxrl_az.py"}


@pytest.mark.parametrize("argv", RUN_COMMANDS, ids=" ".join)
def test_run_section_commands_parse_and_build(argv):
    """Every flag exists and every value passes the trainer's checks; --help prints the help."""
    script, args = argv[1], argv[2:]
    if "--help" in args:
        result = run_script(script, *args)
        assert result.returncode == 0 and "--num-seeds" in result.stdout, result.stderr
        return
    module = importlib.import_module(script.removesuffix(".py"))
    extra = {"preset_key": purejaxrl_az.resolve_game} if module is purejaxrl_az else {}
    config = parse_config(module.Config, module.PRESETS, args, **extra)
    module.validate(config, Runtime())
    trainer = module.make_train(config)
    assert trainer.num_updates >= 1
    assert sweep_configs(config, trainer.hyperparams._fields)


def test_multi_host_commands_name_a_process_group():
    found = commands(section("Start the processes", "docs/multi-host.md"), "python purejaxrl_")
    assert len(found) == 2
    for process_id, argv in enumerate(found):
        config = parse_config(purejaxrl_ppo.Config, purejaxrl_ppo.PRESETS, argv[2:])
        assert process_group(config) == {
            "coordinator_address": "10.0.0.1:1234",
            "num_processes": 2,
            "process_id": process_id,
        }


TABLE_ROW = re.compile(r"^\| [^|]+ \| (`[^`]+`|each trainer) \| (.+) \|$", re.M)


def test_the_table_of_common_changes_names_real_code():
    rows = TABLE_ROW.findall(section("Make it yours"))
    assert len(rows) >= 9
    trainers = ["purejaxrl_ppo.py", "purejaxrl_dqn.py", "purejaxrl_az.py"]
    for where, edit in rows:
        files = trainers if where == "each trainer" else [where.strip("`")]
        names = re.findall(r"`(\w+)`", edit)
        sources = [(REPO / f).read_text() for f in files]
        for name in names:
            defined = re.compile(rf"^\s*(def|class) {name}\b|^{name} = ", re.M)
            assert any(defined.search(source) for source in sources), (name, files)


def test_make_it_yours_guide_on_a_copy(tmp_path):
    guide = section("Make it yours")
    bash = code_blocks(guide, "bash")
    fields, loss_line, _ = code_blocks(guide, "python")
    repo = tmp_path / "repo"
    shutil.copytree(
        REPO,
        repo,
        ignore=shutil.ignore_patterns(".git", ".venv", ".ci-venv", "runs", "wandb", "__pycache__"),
    )

    def sh(line: str):
        result = subprocess.run(
            line, shell=True, cwd=repo, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, (line, result.stdout[-2000:], result.stderr[-2000:])
        return result

    (copy_command,) = bash[0].strip().splitlines()
    sh(copy_command)
    source = (repo / "purejaxrl_klppo.py").read_text()

    # The field lines go at the end of their class, where the snippet's "..." puts them.
    config_lines, hyper_lines = fields.split("class HyperParams(NamedTuple):")

    def code_lines(snippet: str) -> list[str]:
        return [line for line in snippet.splitlines() if line.strip() not in ("", "...")]

    config_header, *config_lines = code_lines(config_lines)
    hyper_lines = code_lines(hyper_lines)
    for header, lines in (
        (config_header, config_lines),
        ("class HyperParams(NamedTuple):", hyper_lines),
    ):
        class_end = source.index("\n\n\n", source.index(header))
        source = source[:class_end] + "\n" + "\n".join(lines) + source[class_end:]
    anchor = "    return loss, info\n"
    assert source.count(anchor) == 1 and "`return loss, info`" in guide
    source = source.replace(anchor, loss_line.rstrip("\n") + "\n" + anchor)
    assert source.count('algo="ppo"') == 1 and '`algo="klppo"`' in guide
    source = source.replace('algo="ppo"', 'algo="klppo"')
    (repo / "purejaxrl_klppo.py").write_text(source)

    run_line, sed_line, pytest_line = bash[1].strip().splitlines()
    tiny = (
        " --total-timesteps 1024 --num-envs 4 --num-steps 16 --updates-per-chunk 8"
        " --eval-episodes 1 --no-progress"
    )
    result = sh(run_line.replace("python ", f"{sys.executable} ", 1) + tiny)
    run_dir = result.stdout.strip().splitlines()[-1].split("-> ")[-1]
    assert "CartPole-v1__klppo__" in run_dir
    assert '"kl_coef": 0.1' in (repo / run_dir / "config.json").read_text()
    sh(sed_line)
    result = sh(pytest_line.replace("python ", f"{sys.executable} ", 1) + " -q -p no:cacheprovider")
    assert " passed" in result.stdout


def test_the_bare_training_snippet_runs_two_seeds():
    """The guide's PureJaxRL-style snippet, run as written: one compiled program, two seeds."""
    *_, snippet = code_blocks(section("Make it yours"), "python")
    namespace = {}
    exec(snippet, namespace)
    assert namespace["metrics"]["episode_return"].shape == (2, 4)
