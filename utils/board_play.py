"""Trained AlphaZero runs outside training: a game against you in the terminal (`--play RUN`)
and two runs head to head (`--arena RUN_A RUN_B`).

    python purejaxrl_az.py --play runs/tic_tac_toe__az__1__20261201-120000 --human-second
    python purejaxrl_az.py --arena runs/connect_four__az__1__A runs/connect_four__az__1__B
    python purejaxrl_az.py --arena RUN_DIR@update=100 RUN_DIR --eval-games 64

A run is named by its directory, with optional suffixes: `@run=K` picks run K of a directory
that trained several (seeds x sweep configurations, configuration-major, as in metrics.csv;
default 0) and `@update=N` its checkpoint after update N (default the latest; older ones are
kept with --keep-checkpoints). Each run plays with its own network and settings from its
config.json; the agent's move is the trained network's greedy search (no Gumbel or Dirichlet
noise, temperature 0) at the run's --num-simulations, or the one given here. 2048 has no
opponent: --play replays one game of the agent's, move by move, and --arena refuses it.

The arena reuses the in-loop evaluation (utils/board_eval.py): its match loop, scores and Elo.
Greedy search is deterministic, so every game from one seat would be the same game: each pair
of games (one from each seat) starts instead from the same random opening of
--opening-plies plies.

The trainer's pieces come from the trainer module passed in (`purejaxrl_az`): its Config,
`make_train` (for the checkpoint's layout), `make_networks`, `agent_search`,
`agent_simulations`, `variables_of`, `resolve_game`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import string
import sys
import time
import warnings
from typing import Any, NamedTuple, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import pgx

from utils import checkpoint, game2048
from utils.board_eval import match_metrics, play_against, save_game_svg
from utils.devices import DEVICE_AXIS, use_compile_cache
from utils.errors import ConfigError
from utils.logs import read_json, write_json

# ---------------------------------------------------------------------------------------------
# Runs: RUN_DIR[@run=K][@update=N] -> the trained network and its search
# ---------------------------------------------------------------------------------------------

_SUFFIX = re.compile(r"@(run|update)=([^@]*)$")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A run as named on the command line."""

    run_dir: str
    run: int | None = None  # index among the directory's runs (None: 0)
    update: int | None = None  # checkpoint (None: the latest)

    @property
    def label(self) -> str:
        """The run's short name: its directory's name and the suffixes given."""
        name = os.path.basename(os.path.normpath(self.run_dir))
        if self.run is not None:
            name += f"@run={self.run}"
        if self.update is not None:
            name += f"@update={self.update}"
        return name


def parse_run_spec(text: str, flag: str) -> RunSpec:
    """RUN_DIR, RUN_DIR@run=K, RUN_DIR@update=N or both, in any order."""
    values: dict[str, int] = {}
    rest = text
    while match := _SUFFIX.search(rest):
        name, value = match.groups()
        if name in values:
            raise ConfigError(f"{flag} {text!r} gives @{name}= twice")
        if not value.isdigit():
            raise ConfigError(f"{flag} {text!r}: @{name}= takes a number >= 0, got {value!r}")
        values[name] = int(value)
        rest = rest[: match.start()]
    return RunSpec(rest, values.get("run"), values.get("update"))


class Agent(NamedTuple):
    """One trained run, loaded: what its search needs."""

    spec: RunSpec
    config: Any  # the trainer's Config, from config.json
    game: str
    run: int
    num_runs: int
    update: int
    variables: dict  # the network's variables (parameters and BatchNorm statistics)
    hparams: Any  # the run's HyperParams
    env: Any
    network: Any


def saved_config(spec: RunSpec, trainer, flag: str):
    """(the trainer's Config, the game) of an AlphaZero run directory, from its config.json;
    anything else is a ConfigError of one sentence."""
    run_dir = spec.run_dir
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{flag}: {run_dir!r} is not a directory")
    if not os.path.isfile(os.path.join(run_dir, "config.json")):
        raise ConfigError(f"{flag}: {run_dir!r} has no config.json, so it is not a run directory")
    if os.path.isfile(os.path.join(run_dir, "run.json")):
        algo = read_json(os.path.join(run_dir, "run.json"), flag).get("algo", "az")
        if algo != "az":
            raise ConfigError(
                f"{flag}: {run_dir!r} is a {algo} run; only AlphaZero runs play board games"
            )
    saved = read_json(os.path.join(run_dir, "config.json"), flag)
    names = {field.name for field in dataclasses.fields(trainer.Config)}
    try:
        config = trainer.Config(
            **{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in names}
        )
        game = trainer.resolve_game(config.env)
    except (TypeError, ConfigError) as error:
        raise ConfigError(f"{flag}: {run_dir!r} is not an AlphaZero run ({error})") from None
    return config, game


def load_agent(spec: RunSpec, trainer, flag: str) -> Agent:
    """The network of one run of a run directory, from its config.json and checkpoint. Every
    way this can fail is a ConfigError of one sentence."""
    config, game = saved_config(spec, trainer, flag)
    run_dir = spec.run_dir
    directory = os.path.join(run_dir, "checkpoints")
    kept = checkpoint.updates(directory)
    if not kept:
        raise ConfigError(f"{flag}: {run_dir!r} has no checkpoint yet")
    update = kept[-1] if spec.update is None else spec.update
    if update not in kept:
        raise ConfigError(
            f"{flag}: {run_dir!r} has no checkpoint after update {update}; it keeps "
            f"{', '.join(map(str, kept))} (train with --keep-checkpoints to keep more)"
        )
    leaves, _ = checkpoint.read(directory, update)
    state = _state_of(trainer, config, leaves, run_dir, flag)
    num_runs = jax.tree.leaves(state)[0].shape[1]
    run = spec.run or 0
    if run >= num_runs:
        raise ConfigError(
            f"{flag}: {run_dir!r} holds {num_runs} run(s) (seeds x sweep configurations), "
            f"numbered from 0; there is no @run={run}"
        )
    state = jax.tree.map(lambda x: x[0, run], state)  # device 0 (all devices hold the same)
    env = pgx.make(game)
    on_cpu = jax.default_backend() == "cpu"  # only the search network plays
    network, _ = trainer.make_networks(config, env, one_run=True, on_cpu=on_cpu)
    variables = trainer.variables_of(state, config.batch_norm)
    return Agent(spec, config, game, run, num_runs, update, variables, state.hparams, env, network)


def _state_of(trainer, config, leaves, run_dir: str, flag: str):
    """A checkpoint's leaves (each [devices, runs, ...]) in the trainer's state structure."""
    train = trainer.make_train(config)
    shapes = jax.eval_shape(
        jax.vmap(lambda key: train.init(key, train.hyperparams), axis_name=DEVICE_AXIS),
        jax.random.split(jax.random.PRNGKey(0), 1),
    )
    structure = jax.tree.structure(shapes)
    layouts_match = len(leaves) == structure.num_leaves and all(
        np.ndim(leaf) == len(shape.shape) + 1
        for leaf, shape in zip(leaves, jax.tree.leaves(shapes), strict=False)
    )
    if not layouts_match:
        raise ConfigError(f"{flag}: the checkpoint of {run_dir!r} does not match its config.json")
    return jax.tree.unflatten(structure, leaves)


def simulations(trainer, config, num_simulations: int | None) -> int:
    """The simulations per move of a run's agent: `num_simulations` where given, else those
    its evaluation searched with (the trainer's `agent_simulations`)."""
    return num_simulations or trainer.agent_simulations(config)


def make_search(trainer, agent: Agent, num_simulations: int | None):
    """(variables, hparams, key, games [B]) -> mctx.PolicyOutput: the run's greedy search at
    `simulations(...)` per move."""
    config = agent.config
    return functools.partial(
        trainer.agent_search,
        env=agent.env,
        network=agent.network,
        search=config.search,
        num_simulations=simulations(trainer, config, num_simulations),
        max_num_considered_actions=config.max_num_considered_actions,
        greedy=True,
    )


# ---------------------------------------------------------------------------------------------
# Boards in text, and moves typed in
# ---------------------------------------------------------------------------------------------

MARKS = "XO"  # the first player's stones, the second player's


def _grid(game: str) -> tuple[int, int]:
    return {
        "othello": (8, 8),
        "hex": (11, 11),
        "go_9x9": (9, 9),
        "go_19x19": (19, 19),
    }[game]


def _colours(game: str, state) -> np.ndarray:
    """Each cell's owner (0: the first player, 1: the second, -1: empty), row-major."""
    x = state._x
    board = np.asarray(x.board)
    if game in ("tic_tac_toe", "connect_four"):
        return board
    if game == "othello":  # the mover's stones are positive; turn 0 is the first player
        absolute = board if int(x.turn) == 0 else -board
    elif game == "hex":  # the mover's stones are positive; the mover is step_count % 2
        absolute = board if int(x.step_count) % 2 == 0 else -board
    else:  # go: black (the first player) positive
        absolute = board
    return np.where(absolute > 0, 0, np.where(absolute < 0, 1, -1))


def _coordinate(game: str, action: int) -> str:
    rows, cols = _grid(game)
    if action >= rows * cols:
        return "swap" if game == "hex" else "pass"
    return f"{string.ascii_lowercase[action % cols]}{action // cols + 1}"


MOVES_2048 = ("left", "up", "right", "down")


def move_name(game: str, action: int) -> str:
    """How a move is written, the way `parse_move` reads it."""
    if game == "2048":
        return MOVES_2048[action]
    if game in ("tic_tac_toe", "connect_four"):
        return str(action + 1)
    if game in ("othello", "hex", "go_9x9", "go_19x19"):
        return _coordinate(game, action)
    return str(action)


def move_help(game: str) -> str:
    """What to type, in a few words."""
    return {
        "tic_tac_toe": "a cell 1-9",
        "connect_four": "a column 1-7",
        "othello": "a square such as d3, or pass",
        "hex": "a cell such as f6, or swap (second move only)",
        "go_9x9": "a point such as e5, or pass",
        "go_19x19": "a point such as k10, or pass",
    }.get(game, "a move number from the list of legal moves")


def parse_move(game: str, text: str, num_actions: int) -> int | None:
    """The action a typed move names (legal or not), or None if it names none."""
    text = text.strip().lower()
    if game in ("tic_tac_toe", "connect_four"):
        return int(text) - 1 if text.isdigit() and 1 <= int(text) <= num_actions else None
    if game in ("othello", "hex", "go_9x9", "go_19x19"):
        rows, cols = _grid(game)
        if text in ("pass", "swap"):
            special = rows * cols
            return special if (text == "swap") == (game == "hex") else None
        match = re.fullmatch(r"([a-z])(\d{1,2})", text)
        if not match:
            return None
        col, row = string.ascii_lowercase.index(match.group(1)), int(match.group(2)) - 1
        return row * cols + col if col < cols and 0 <= row < rows else None
    return int(text) if text.isdigit() and int(text) < num_actions else None


def illegal_reason(game: str, action: int) -> str:
    """Why a move that names a real cell cannot be played now."""
    if game == "tic_tac_toe":
        return f"cell {action + 1} is taken"
    if game == "connect_four":
        return f"column {action + 1} is full"
    return f"{move_name(game, action)} is not a legal move here"


def render(game: str, state) -> str:
    """The board as text, with the coordinates that moves are typed in."""
    if game == "tic_tac_toe":
        cells = [MARKS[c] if c >= 0 else str(i + 1) for i, c in enumerate(_colours(game, state))]
        rows = [" " + " | ".join(cells[r * 3 : r * 3 + 3]) for r in range(3)]
        return "\n---+---+---\n".join(rows)
    if game == "connect_four":
        board = _colours(game, state).reshape(6, 7)
        lines = [" ".join(MARKS[c] if c >= 0 else "." for c in row) for row in board]
        return "\n".join([" ".join("1234567"), *lines])
    if game in ("othello", "hex", "go_9x9", "go_19x19"):
        rows, cols = _grid(game)
        board = _colours(game, state).reshape(rows, cols)
        header = "    " + " ".join(string.ascii_lowercase[:cols])
        lines = [header]
        for r in range(rows):
            indent = " " * r if game == "hex" else ""  # hex cells lean right row by row
            cells = " ".join(MARKS[c] if c >= 0 else "." for c in board[r])
            lines.append(f"{indent}{r + 1:>3} {cells}")
        if game == "hex":
            lines.append("X joins the top and bottom edges, O the left and right")
        return "\n".join(lines)
    if game == "2048":
        board = np.asarray(game2048.board_of(state.observation)).reshape(4, 4)
        return "\n".join(" ".join(f"{2**e if e else '.':>5}" for e in row) for row in board)
    return _render_generic(state)


def _render_generic(state) -> str:
    """Chess-like games: the position in FEN where pgx writes it, else each cell's first set
    observation plane as a letter; the moves are pgx's action numbers."""
    legal = np.flatnonzero(np.asarray(state.legal_action_mask))
    shown = " ".join(map(str, legal[:60])) + (" ..." if len(legal) > 60 else "")
    if hasattr(state, "_to_fen"):
        with warnings.catch_warnings():  # deprecated for pgx.experimental, which lacks gardner
            warnings.simplefilter("ignore", DeprecationWarning)
            board = state._to_fen()
    else:
        obs = np.asarray(state.observation)
        obs = obs[..., ~obs.all((0, 1))][..., :26]  # a plane set everywhere is not a piece
        first = np.where(obs.any(-1), obs.argmax(-1), -1)
        board = "\n".join(
            " ".join(string.ascii_lowercase[p] if p >= 0 else "." for p in row) for row in first
        )
        board += "\n(a cell shows its first set observation plane, a = the first one not set on every cell)"
    return f"{board}\nlegal moves: {shown}"


# ---------------------------------------------------------------------------------------------
# --play: a game in the terminal
# ---------------------------------------------------------------------------------------------


QUIT = -1  # what `_human_move` returns for q


class _Input:
    """The human's lines. On a terminal, a prompt; from a pipe, no prompt, one line at a time,
    each echoed so that the transcript reads as a game."""

    def __init__(self, stream: TextIO, out: TextIO):
        self.stream, self.out = stream, out
        self.interactive = stream.isatty()

    def line(self, prompt: str) -> str | None:
        """The next line, or None at the end of the input."""
        if self.interactive:
            self.out.write(prompt)
            self.out.flush()
        text = self.stream.readline()
        if not text:
            if self.interactive:  # Ctrl-D: the cursor is still after the prompt
                self.out.write("\n")
            return None
        if not self.interactive:
            self.out.write(f"{prompt}{text.rstrip()}\n")
        return text.rstrip("\n")


def _agent_move(trainer, agent: Agent, num_simulations: int | None):
    """The compiled (variables, hparams, key, state) -> (move, the root's visit shares [A],
    the search's action weights [A], the root's value) of the run's greedy search."""
    search = make_search(trainer, agent, num_simulations)

    @jax.jit
    def agent_move(variables, hparams, key, state):
        games = jax.tree.map(lambda x: x[None], state)
        output = search(variables, hparams, key, games)
        summary = output.search_tree.summary()
        visits = summary.visit_probs[0, : agent.env.num_actions]  # 2048: chance children after
        return output.action[0], visits, output.action_weights[0], summary.value[0]

    return agent_move


def _search_line(game: str, action: int, visits, weights, value, whose: str) -> str:
    """'agent plays X (search visits: ...; value ...)': the most visited moves; among equal
    visits, the search's preferred ones first."""
    visits = np.asarray(visits)
    top = np.lexsort((-np.asarray(weights), -visits))[:3]
    shares = ", ".join(f"{move_name(game, int(a))} {visits[a]:.0%}" for a in top if visits[a] > 0)
    return (
        f"agent plays {move_name(game, action)} (search visits: {shares}; value {whose}"
        f"{float(value):+.2f})"
    )


def replay_2048(trainer, agent: Agent, args, stdout: TextIO) -> None:
    """One game of the run's agent at 2048, each move printed with the board it leaves (the
    new tile included), then the score, highest tile and moves."""
    env, sims = agent.env, simulations(trainer, agent.config, args.num_simulations)
    agent_move = _agent_move(trainer, agent, args.num_simulations)
    step = jax.jit(env.step)
    key, init_key = jax.random.split(jax.random.PRNGKey(args.seed))
    state = jax.jit(env.init)(init_key)
    print(
        f"2048: {agent.spec.label} (update {agent.update}, {sims} simulations per move) plays "
        "one game; values are the expected merge rewards still to come.",
        file=stdout,
    )
    print(f"\n{render('2048', state)}", file=stdout)
    score = moves = 0
    while not bool(state.terminated):
        key, search_key, spawn_key = jax.random.split(key, 3)
        action, visits, weights, value = agent_move(
            agent.variables, agent.hparams, search_key, state
        )
        state = step(state, action, spawn_key)
        score, moves = score + int(state.rewards[0]), moves + 1
        line = _search_line("2048", int(action), visits, weights, value, "")
        print(f"\nmove {moves}: {line}, score {score}\n{render('2048', state)}", file=stdout)
        stdout.flush()
    highest = 2 ** int(np.asarray(game2048.board_of(state.observation)).max())
    print(f"\nGame over: score {score}, highest tile {highest}, {moves} moves.", file=stdout)


def play(trainer, args, stdin: TextIO, stdout: TextIO) -> None:
    """One game between the human (stdin) and the run's agent, drawn on stdout; 2048 replays
    one game of the agent's alone (`replay_2048`)."""
    agent = load_agent(parse_run_spec(args.play, "--play"), trainer, "--play")
    game, env = agent.game, agent.env
    if agent.num_runs > 1 and agent.spec.run is None:
        print(
            f"{agent.spec.run_dir} holds {agent.num_runs} runs; this is run 0 (pick another "
            "with RUN_DIR@run=K)",
            file=stdout,
        )
    if game == "2048":
        replay_2048(trainer, agent, args, stdout)
        return
    agent_move = _agent_move(trainer, agent, args.num_simulations)
    step = jax.jit(env.step)
    key = jax.random.PRNGKey(args.seed)
    key, init_key = jax.random.split(key)
    state = jax.jit(env.init)(init_key)  # compiled: op by op, shogi's takes many seconds
    human = int(state.current_player) if not args.human_second else 1 - int(state.current_player)
    human_mark = MARKS[0 if not args.human_second else 1]
    sims = simulations(trainer, agent.config, args.num_simulations)
    print(
        f"{game}: you are {human_mark} and move {'second' if args.human_second else 'first'}, "
        f"against {agent.spec.label} (update {agent.update}, {sims} simulations per move). "
        f"Type {move_help(game)}; q quits.",
        file=stdout,
    )
    reader = _Input(stdin, stdout)
    while not (bool(state.terminated) or bool(state.truncated)):
        print(f"\n{render(game, state)}\n", file=stdout)
        if int(state.current_player) == human:
            action = _human_move(game, state, reader, stdout, env.num_actions)
            if action is None:
                print("Input ended before the game did; no result.", file=stdout)
                return
            if action == QUIT:
                print("You quit; no result.", file=stdout)
                return
            stdout.flush()
        else:
            key, search_key = jax.random.split(key)
            action, visits, weights, value = agent_move(
                agent.variables, agent.hparams, search_key, state
            )
            action = int(action)
            print(_search_line(game, action, visits, weights, value, "for the agent "), file=stdout)
        state = step(state, jnp.int32(action))
    print(f"\n{render(game, state)}\n", file=stdout)
    result = float(state.rewards[human])
    ending = "" if bool(state.terminated) else " (the game hit its move limit)"
    verdict = "You win." if result > 0 else "The agent wins." if result < 0 else "Draw."
    print(verdict + ending, file=stdout)


def _human_move(game, state, reader: _Input, stdout: TextIO, num_actions: int) -> int | None:
    """The human's legal move, asked for until one comes; QUIT for q, None at the end of the
    input."""
    legal = np.asarray(state.legal_action_mask)
    while True:
        text = reader.line("your move: ")
        if text is None:
            return None
        if text.strip().lower() in ("q", "quit", "exit"):
            return QUIT
        action = parse_move(game, text, num_actions)
        if action is None:
            print(f"{text.strip()!r} is not a move: type {move_help(game)}, or q.", file=stdout)
        elif not legal[action]:
            print(f"{illegal_reason(game, action)}: try another move.", file=stdout)
        else:
            return action


# ---------------------------------------------------------------------------------------------
# --arena: two runs head to head
# ---------------------------------------------------------------------------------------------


def with_opening(player, plies: int, opening_key):
    """`player` (games [B], key) -> actions, except in a game's first `plies` plies, where the
    move is random and depends only on the game's index in the batch and the ply: the two
    seats' games of the same index start from the same opening."""

    def opening_move(index, ply, legal):
        key = jax.random.fold_in(jax.random.fold_in(opening_key, index), ply)
        return jax.random.categorical(key, jnp.where(legal, 0.0, -jnp.inf))

    def move(games, key):
        ply = games._step_count
        index = jnp.arange(ply.shape[0])
        random = jax.vmap(opening_move)(index, ply, games.legal_action_mask)
        return jnp.where(ply < plies, random, player(games, key))

    return move


def arena_runs(trainer, args) -> tuple[RunSpec, RunSpec]:
    """The two runs of --arena, once its flags and the runs' games are known to allow a match;
    otherwise a ConfigError of one sentence."""
    spec_a, spec_b = (parse_run_spec(text, "--arena") for text in args.arena)
    if args.eval_games < 2 or args.eval_games % 2:
        raise ConfigError(f"--eval-games must be a positive even number, got {args.eval_games}")
    if args.opening_plies < 0:
        raise ConfigError(f"--opening-plies must be >= 0, got {args.opening_plies}")
    (_, game_a), (_, game_b) = (saved_config(spec, trainer, "--arena") for spec in (spec_a, spec_b))
    if "2048" in (game_a, game_b):
        raise ConfigError(
            "--arena: 2048 is a single-player game, so its runs meet no opponent; compare their "
            "eval_score in metrics.csv, or replay a game of each with --play"
        )
    if game_a != game_b:
        raise ConfigError(
            f"--arena: {spec_a.label} plays {game_a} and {spec_b.label} {game_b}; an arena "
            "needs two runs of the same game"
        )
    return spec_a, spec_b


def arena(trainer, args, stdout: TextIO) -> dict:
    """`args.eval_games` games between two runs, half with each moving first: W/D/L, score and
    Elo of A against B (utils/board_eval.py), written with the per-game results and one game
    record per seat into the arena directory. Returns what arena.json holds."""
    spec_a, spec_b = arena_runs(trainer, args)
    a = load_agent(spec_a, trainer, "--arena")
    b = load_agent(spec_b, trainer, "--arena")
    out_dir = args.arena_dir or os.path.join(
        "runs", f"arena__{spec_a.label}__vs__{spec_b.label}__{time.strftime('%Y%m%d-%H%M%S')}"
    )
    search_a = make_search(trainer, a, args.num_simulations)
    search_b = make_search(trainer, b, args.num_simulations)
    env = a.env

    def match(variables_a, hparams_a, variables_b, hparams_b, key):
        opening_key, key = jax.random.split(key)

        def agent_a(games, key):
            return search_a(variables_a, hparams_a, key, games).action

        def agent_b(games, key):
            return search_b(variables_b, hparams_b, key, games).action

        output = play_against(
            with_opening(agent_a, args.opening_plies, opening_key),
            0,
            key,
            env=env,
            players=[with_opening(agent_b, args.opening_plies, opening_key)],
            num_games=args.eval_games,
            oracle_table=None,
            capture_video=True,
        )
        return output, match_metrics("b", output.result)

    one_device = jax.jit(jax.vmap(match, axis_name=DEVICE_AXIS))
    start = time.perf_counter()
    output, metrics = one_device(
        *jax.tree.map(lambda x: x[None], (a.variables, a.hparams, b.variables, b.hparams)),
        jax.random.PRNGKey(args.seed)[None],
    )
    output, metrics = jax.device_get((jax.tree.map(lambda x: x[0], output), metrics))
    seconds = time.perf_counter() - start
    metrics = {name.removeprefix("eval_b_"): float(value[0]) for name, value in metrics.items()}
    results = np.asarray(output.result)  # [seat, game]: A's result, row 0 with A first
    counts = {f"a_{name}": int(np.sum(results == r)) for name, r in (("wins", 1), ("draws", 0))}
    counts["b_wins"] = int(np.sum(results == -1))

    def describe(agent: Agent) -> dict:
        config = agent.config
        return {
            "run_dir": os.path.abspath(agent.spec.run_dir),
            "run": agent.run,
            "update": agent.update,
            "num_simulations": simulations(trainer, config, args.num_simulations),
            "network": f"{config.num_blocks} blocks x {config.num_channels} channels",
        }

    half = results.shape[1]
    report = {
        "game": a.game,
        "a": describe(a),
        "b": describe(b),
        "games": int(results.size),
        "opening_plies": args.opening_plies,
        "seed": args.seed,
        **counts,
        **{f"a_{name}": value for name, value in metrics.items()},
        "seconds": seconds,
        "per_game": [
            {"game": seat * half + i, "pair": i, "a_first": seat == 0, "a_result": int(r)}
            for seat in range(2)
            for i, r in enumerate(results[seat])
        ],
    }
    os.makedirs(os.path.join(out_dir, "games"), exist_ok=True)
    write_json(os.path.join(out_dir, "arena.json"), report)
    for seat, name in enumerate(("a_first", "b_first")):
        save_game_svg(
            env,
            output.record_keys[seat],
            output.record_moves[seat],
            os.path.join(out_dir, "games", f"{name}.svg"),
        )
    print(
        f"{a.game}: {spec_a.label} vs {spec_b.label}, {results.size} games: "
        f"{counts['a_wins']} W / {counts['a_draws']} D / {counts['b_wins']} L for A, "
        f"score {metrics['score']:.3f}, Elo {metrics['elo']:+.0f} "
        f"(95% CI {metrics['elo_low']:+.0f}, {metrics['elo_high']:+.0f}); {out_dir}",
        file=stdout,
    )
    return report


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def requested(args: list[str]) -> bool:
    """Whether the command line asks for a game or an arena rather than training."""
    return any(arg.split("=")[0] in ("--play", "--arena") for arg in args)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence and exit code 2, as a bad training flag
        raise ConfigError(message)


def parse_args(args: list[str]) -> argparse.Namespace:
    parser = _Parser(
        prog="purejaxrl_az.py",
        description="Play a trained run (--play) or two runs against each other (--arena). "
        "A run is RUN_DIR, RUN_DIR@run=K (run K of a seed or sweep directory) and/or "
        "RUN_DIR@update=N (its checkpoint after update N).",
    )
    modes = parser.add_mutually_exclusive_group(required=True)
    modes.add_argument("--play", metavar="RUN", help="play a game against this run")
    modes.add_argument("--arena", nargs=2, metavar=("RUN_A", "RUN_B"), help="two runs' match")
    seats = parser.add_mutually_exclusive_group()
    seats.add_argument("--human-first", action="store_true", help="you move first (default)")
    seats.add_argument("--human-second", action="store_true", help="the agent moves first")
    parser.add_argument(
        "--num-simulations",
        type=int,
        default=None,
        help="search simulations per move (default: those of each run's evaluation)",
    )
    parser.add_argument("--eval-games", type=int, default=64, help="arena games, half per seat")
    parser.add_argument(
        "--opening-plies",
        type=int,
        default=2,
        help="arena: random plies that open each pair of games (default 2)",
    )
    parser.add_argument(
        "--arena-dir",
        default=None,
        help="where arena.json and the game records go (default runs/arena__A__vs__B__TIME)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the openings and searches")
    parser.add_argument(
        "--no-compile-cache", dest="compile_cache", action="store_false",
        help="do not keep compiled programs in the per-user cache",
    )  # fmt: skip
    parsed = parser.parse_args(args)
    if parsed.num_simulations is not None and parsed.num_simulations < 1:
        raise ConfigError(f"--num-simulations must be >= 1, got {parsed.num_simulations}")
    return parsed


def main(trainer, args: list[str] | None = None, stdin=None, stdout=None) -> None:
    """--play or --arena; a ConfigError is the caller's to report (one sentence, exit code 2)."""
    parsed = parse_args(list(sys.argv[1:] if args is None else args))
    use_compile_cache(parsed.compile_cache)
    if parsed.play is not None:
        play(trainer, parsed, stdin or sys.stdin, stdout or sys.stdout)
    else:
        arena(trainer, parsed, stdout or sys.stdout)
