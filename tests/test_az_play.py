"""A trained AlphaZero run outside training (utils/board_play.py): --play against a scripted
human through piped input, --arena between runs, and the checkpoints --keep-checkpoints keeps
for `RUN_DIR@update=N`. One tiny tic_tac_toe run serves the whole module."""

import contextlib
import io
import json
import os
import pty
import select
import shutil
import subprocess
import sys

import jax
import numpy as np
import pgx
import pytest

import purejaxrl_az
from tests.helpers import REPO, _script_env, run_script
from utils import board_play, checkpoint
from utils.errors import ConfigError

VERDICTS = ("You win.", "The agent wins.", "Draw.")


# TINY_AZ grown just enough to learn something in 12 iterations (about 8 s of training after a
# 40 s compile), with a checkpoint after every iteration, all of them kept: its update 12 beats
# its update 1 in the arena.
SMALL_AZ = [
    "--env", "tic_tac_toe",
    "--num-iterations", "12",
    "--eval-every", "1",
    "--num-games", "64",
    "--rollout-steps", "16",
    "--buffer-size", "4096",
    "--minibatch-size", "128",
    "--updates-per-iteration", "8",
    "--num-blocks", "1",
    "--num-channels", "16",
    "--num-simulations", "8",
    "--max-num-considered-actions", "9",
    "--eval-games", "8",
    "--baseline-sims", "4",
    "--cpu-devices", "0",
    "--keep-checkpoints", "0",
    "--checkpoint-every", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    runs = tmp_path_factory.mktemp("runs")
    result = run_script("purejaxrl_az.py", *SMALL_AZ, "--no-progress", "--runs-dir", str(runs))
    assert result.returncode == 0, result.stderr
    (run_dir,) = runs.iterdir()
    return run_dir


def play(run_dir, moves: str, *flags) -> str:
    """One --play game in this process, the human's lines piped in; its transcript."""
    out = io.StringIO()
    board_play.main(purejaxrl_az, ["--play", str(run_dir), *flags], io.StringIO(moves), out)
    return out.getvalue()


def test_keep_checkpoints_keeps_the_newest_n(small_run, tmp_path):
    assert checkpoint.updates(str(small_run / "checkpoints")) == list(range(1, 13))  # 0: all
    for update in range(1, 5):
        checkpoint.save(str(tmp_path), update, {"w": np.full(2, update)}, {"u": update}, keep=2)
    assert checkpoint.updates(str(tmp_path)) == [3, 4]
    leaves, meta = checkpoint.read(str(tmp_path), 3)
    np.testing.assert_array_equal(leaves[0], [3, 3])
    assert meta == {"u": 3}


def test_a_whole_game_through_the_command_line_with_piped_moves(small_run):
    """The scripted human tries cells 1 to 9 in order: a taken cell is refused with a sentence
    and the next line is read, so the game always reaches its end."""
    result = subprocess.run(
        [sys.executable, "purejaxrl_az.py", "--play", str(small_run)],
        input="".join(f"{cell}\n" for cell in range(1, 10)),
        cwd=REPO,
        env=_script_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("tic_tac_toe: you are X and move first")
    assert " 1 | 2 | 3\n---+---+---\n 4 | 5 | 6\n---+---+---\n 7 | 8 | 9" in out
    assert out.count("agent plays ") >= 2 and "search visits: " in out and "value for the" in out
    assert out.rstrip().splitlines()[-1] in VERDICTS
    assert "Traceback" not in result.stderr


def test_bad_moves_get_a_sentence_and_another_try(small_run):
    out = play(small_run, "5\n5\n0\nx\n10\nq\n", "--human-second", "--num-simulations", "2")
    assert "move second" in out and "2 simulations per move" in out
    assert out.index("agent plays") < out.index("your move: 5")  # the agent opened
    # the agent's opening cell, or the human's 5 once played, is taken
    assert "is taken: try another move." in out
    assert "'0' is not a move: type a cell 1-9, or q." in out
    assert "'x' is not a move" in out and "'10' is not a move" in out
    assert out.rstrip().endswith("You quit; no result.")


def test_input_that_ends_mid_game_is_a_clean_quit(small_run):
    out = play(small_run, "1\n")
    assert "your move: 1" in out
    assert out.rstrip().endswith("Input ended before the game did; no result.")


def test_bad_runs_are_one_sentence_and_exit_code_2(small_run, tmp_path):
    ppo = tmp_path / "ppo_run"
    ppo.mkdir()
    (ppo / "config.json").write_text(json.dumps({"env": "CartPole"}))
    (ppo / "run.json").write_text(json.dumps({"algo": "ppo", "env_id": "CartPole-v1"}))
    result = run_script("purejaxrl_az.py", "--play", str(ppo))
    assert result.returncode == 2
    assert result.stderr == (
        f"error: --play: {str(ppo)!r} is a ppo run; only AlphaZero runs play board games\n"
    )
    cases = {
        str(tmp_path / "missing"): "is not a directory",
        str(tmp_path): "has no config.json, so it is not a run directory",
        f"{small_run}@update=13": "has no checkpoint after update 13; it keeps 1, 2, 3, 4, ",
        f"{small_run}@run=1": r"holds 1 run\(s\)",
        f"{small_run}@update=x": "@update= takes a number",
    }
    for spec, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            play(spec, "")
    empty = tmp_path / "empty"
    shutil.copytree(small_run, empty, ignore=shutil.ignore_patterns("checkpoints"))
    with pytest.raises(ConfigError, match="has no checkpoint yet"):
        play(empty, "")


def arena(*args) -> dict:
    out = io.StringIO()
    board_play.main(purejaxrl_az, ["--arena", *map(str, args)], stdout=out)
    (line,) = out.getvalue().splitlines()
    return line


def test_a_run_against_itself_scores_exactly_one_half(small_run, tmp_path):
    """Greedy search is deterministic and every pair of games opens alike, one game from each
    seat, so each pair ends in a win and a loss or in two draws."""
    line = arena(small_run, small_run, "--eval-games", "8", "--arena-dir", tmp_path / "self")
    report = json.loads((tmp_path / "self" / "arena.json").read_text())
    assert report["a_wins"] == report["b_wins"] and report["a_score"] == 0.5
    assert report["a_elo"] == 0.0 and report["a_elo_low"] < 0 < report["a_elo_high"]
    by_pair = {}
    for game in report["per_game"]:
        by_pair.setdefault(game["pair"], []).append(game["a_result"])
    assert all(sorted(results) in ([-1, 1], [0, 0]) for results in by_pair.values())
    assert len(report["per_game"]) == 8
    assert sorted(os.listdir(tmp_path / "self" / "games")) == ["a_first.svg", "b_first.svg"]
    assert line.startswith("tic_tac_toe: ") and ", 8 games: " in line and "score 0.500" in line


def test_a_run_beats_its_first_iteration_and_arena_refusals(small_run, tmp_path):
    """Update 12 against update 1 of the same run, 32 games from 16 openings."""
    arena(
        f"{small_run}@update=12", f"{small_run}@update=1", "--eval-games", "32",
        "--arena-dir", tmp_path / "a",
    )  # fmt: skip
    report = json.loads((tmp_path / "a" / "arena.json").read_text())
    assert (report["a"]["update"], report["b"]["update"]) == (12, 1)
    assert report["a_wins"] + report["a_draws"] + report["b_wins"] == 32
    assert report["a_score"] > 0.6 and report["a_elo_low"] > 0, report
    other = tmp_path / "connect_four_run"
    shutil.copytree(small_run, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "env": "connect_four"}))
    with pytest.raises(ConfigError, match=r"plays tic_tac_toe and .* connect_four; an arena"):
        arena(small_run, other)
    with pytest.raises(ConfigError, match="--eval-games must be a positive even number"):
        arena(small_run, small_run, "--eval-games", "3")


def test_a_terminal_gets_a_prompt_and_q_quits(small_run):
    """The same command on a pseudo-terminal: a prompt, the typed move, then q."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "purejaxrl_az.py", "--play", str(small_run)],
        stdin=terminal,
        stdout=terminal,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env=_script_env(),
    )
    os.close(terminal)
    output = b""

    def read_until(text: bytes):
        nonlocal output
        while text not in output:
            ready, _, _ = select.select([controller], [], [], 120)
            assert ready, output
            output += os.read(controller, 4096)

    read_until(b"your move: ")
    os.write(controller, b"1\n")
    read_until(b"agent plays")
    read_until(b"your move: ")
    os.write(controller, b"q\n")
    assert process.wait(timeout=120) == 0, process.stderr.read()
    with contextlib.suppress(OSError):  # the terminal closes with the process
        while chunk := os.read(controller, 4096):
            output += chunk
    os.close(controller)
    text = output.decode().replace("\r\n", "\n")
    assert "your move: 1\n" in text and text.rstrip().endswith("You quit; no result.")


# shogi and animal_shogi (each cell's first observation plane, action numbers) are left out:
# their first positions alone take 10-20 s to build here
@pytest.mark.parametrize(
    "game", [g for g in purejaxrl_az.SUPPORTED_GAMES if not g.endswith("shogi") and g != "2048"]
)
def test_the_games_draw_their_boards_and_read_back_the_moves_they_name(game):
    env = pgx.make(game)
    state = env.init(jax.random.PRNGKey(0))
    board = board_play.render(game, state)
    assert board.strip() and "\n" in board
    for action in np.flatnonzero(np.asarray(state.legal_action_mask)):
        name = board_play.move_name(game, int(action))
        assert board_play.parse_move(game, name, env.num_actions) == action, name
    assert board_play.parse_move(game, "nonsense", env.num_actions) is None


def test_the_small_boards_look_like_their_games():
    env = pgx.make("connect_four")
    state = env.init(jax.random.PRNGKey(0))
    for column in (3, 3, 4):  # columns 4, 4, 5 as typed
        state = env.step(state, column)
    assert board_play.render("connect_four", state).splitlines()[-3:] == [
        ". . . . . . .",
        ". . . O . . .",
        ". . . X X . .",
    ]
    assert board_play.parse_move("connect_four", "8", 7) is None
    assert board_play.illegal_reason("connect_four", 3) == "column 4 is full"


def test_run_k_of_a_directory_that_trained_several(small_run, tmp_path):
    """A directory of two runs made from the small run's checkpoint: run 1's floats are run
    0's plus one."""
    leaves, meta = checkpoint.read(str(small_run / "checkpoints"))
    two_runs = [
        np.concatenate([x, x + 1 if np.issubdtype(x.dtype, np.floating) else x], axis=1)
        for x in leaves
    ]
    two = tmp_path / "two_seeds"
    two.mkdir()
    for name in ("config.json", "run.json"):
        shutil.copy(small_run / name, two / name)
    checkpoint.save(str(two / "checkpoints"), 12, two_runs, meta)
    first, second = (
        board_play.load_agent(board_play.parse_run_spec(spec, "--play"), purejaxrl_az, "--play")
        for spec in (str(two), f"{two}@run=1")
    )
    assert (first.run, second.run, first.num_runs) == (0, 1, 2)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(b, a + 1), first.variables, second.variables
    )
    with pytest.raises(ConfigError, match=r"holds 2 run\(s\).*no @run=2"):
        play(f"{two}@run=2", "")
    assert "holds 2 runs; this is run 0 (pick another with RUN_DIR@run=K)" in play(two, "q\n")
