"""Ctrl-C and SIGTERM at any moment of a run: exit code 130 and one line, never a traceback.

Python's own Ctrl-C raises KeyboardInterrupt wherever the main thread happens to be: inside
JAX's compiler (the process may then crash as it exits), in a weakref callback or `__del__`
(where Python prints "Exception ignored" and carries on, so the run finishes as if nothing
had happened). Here a stop signal raises nothing:

- Before a run has started (imports, flags) nothing is lost: the process exits at once.
- While `run_training` runs, the first signal asks for a stop, which the driver makes at its
  next safe point (`check`: after a compile returns, between chunks, after the final report),
  checkpoint first. A second signal exits at once, though after a checkpoint write in
  progress (`held`).
- The command line then ends its process with `end_process`, without Python's teardown.

A thread reads the signals from the interpreter's wakeup fd: a Python signal handler runs only
once the main thread is back in Python, which a long compile or chunk delays by minutes.

A trainer script imports this module before its slow imports, to make a stop during them quiet
as well; imported by anything else (a notebook, the tests), it changes nothing until
`run_training` starts, and `run_training` gives the signals back when it returns.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

# The signals that stop a run: Ctrl-C, and SIGTERM, which SLURM and Kubernetes send first.
# `_take_over` alone installs their handlers.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_BEFORE_THE_RUN = "interrupted before the run started"


class _State:
    """What a stop signal does now; the listening thread and the main thread share it."""

    def __init__(self):
        self.at_safe_points = False  # inside run_training: the first signal only asks
        self.requested: signal.Signals | None = None
        self.exit_line: Callable[[], str] = lambda: _BEFORE_THE_RUN  # an exit at once says this
        self.said = False  # a line of ours is out: the next needs no blank line first
        self.hold = threading.RLock()  # held by the main thread where an exit would tear files
        self.wakeup: int | None = None  # write end of the listening thread's pipe
        self.for_good = False  # taken over for the whole process (a trainer script)
        self.handing_over: int | None = None  # the main thread's id while it restarts itself


_state = _State()


def _say(line: str) -> None:
    """One line on stderr; the first after a blank one, which leaves the terminal's ^C alone."""
    if line:
        print(f"{'' if _state.said else chr(10)}{line}", file=sys.stderr, flush=True)
        _state.said = True


def _name(stop_signal: int) -> str:
    return "Ctrl-C" if stop_signal == signal.SIGINT else signal.Signals(stop_signal).name


def _exit_at_once() -> None:
    with _state.hold:  # a checkpoint write or a chunk's logs in progress land first
        try:
            line = _state.exit_line()
        except Exception as error:  # the exit must happen whatever the cleanup met
            line = f"interrupted ({error})"
        _say(line)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os._exit(130)


def _listen(read_fd: int) -> None:
    """The listening thread: one byte, the signal's number, per signal received."""
    while received := os.read(read_fd, 1):
        stop_signal = received[0]
        if stop_signal not in STOP_SIGNALS:
            continue
        if _state.handing_over is not None:  # blocked in the main thread: pending across exec
            signal.pthread_kill(_state.handing_over, stop_signal)
        elif _state.at_safe_points and _state.requested is None:
            name = _name(stop_signal)
            _say(
                f"{name}: stopping after the chunk, compile or evaluation in progress; "
                f"{name} again stops at once"
            )
            # asked for once it is said: the main thread's exit line, which a request lets it
            # print, comes after the notice
            _state.requested = signal.Signals(stop_signal)
        else:
            _exit_at_once()


def _noted(*_) -> None:
    """The Python-level handler: the listening thread has the signal already."""


def _signals_to_take() -> tuple[signal.Signals, ...]:
    """The stop signals to take over. In a process group (jax.distributed) SIGTERM stays with
    JAX's preemption notifier, which agrees with every process on one update to stop after
    (the driver asks `multihost_utils.reached_preemption_sync_point` after each chunk): a
    scheduler stopping one process then stops all of them together instead of leaving the
    others waiting on it."""
    jax = sys.modules.get("jax")
    if jax is not None and jax.distributed.is_initialized():
        return (signal.SIGINT,)
    return STOP_SIGNALS


def _take_over() -> Callable[[], None]:
    """Route the stop signals to the listening thread. Returns what gives them back. A signal
    ignored at start-up (a job started with & by a shell script) stays ignored, as Python
    leaves it; off the main thread, where Python cannot catch signals, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    listening = _state.wakeup is not None
    if not listening:
        read_fd, _state.wakeup = os.pipe()
        os.set_blocking(_state.wakeup, False)
    previous_fd = signal.set_wakeup_fd(_state.wakeup, warn_on_full_buffer=False)
    previous = {
        stop_signal: signal.signal(stop_signal, _noted)
        for stop_signal in _signals_to_take()
        if signal.getsignal(stop_signal) is not signal.SIG_IGN
    }
    if not listening:  # started once the handlers are in place: its start can be interrupted
        threading.Thread(target=_listen, args=(read_fd,), name="stop signals", daemon=True).start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by a restart

    def give_back():
        for stop_signal, handler in previous.items():
            if handler is not None:  # None: a handler not set from Python, which we cannot restore
                signal.signal(stop_signal, handler)
        signal.set_wakeup_fd(previous_fd)

    return give_back


def exit_at_once_on_stop_signals() -> None:
    """For the rest of the process, a stop signal outside `run_training` exits at once with one
    line: what a command line wants until its run starts."""
    if not _state.for_good:
        _take_over()
        _state.for_good = True


@contextlib.contextmanager
def stop_at_safe_points():
    """Inside the block a stop signal only asks for a stop, which `check` then raises as
    KeyboardInterrupt; a second signal exits at once, saying `exit_says`'s line. A trainer
    script took the signals over at start-up already; they are taken again here, where a process
    group leaves SIGTERM to JAX (`_signals_to_take`)."""
    give_back = _take_over()
    _state.at_safe_points, _state.requested, _state.said = True, None, False
    exit_says(lambda: _BEFORE_THE_RUN)
    try:
        yield
        if _state.requested is not None:  # asked for after the last safe point: exit all the same
            exit_interrupted(_state.exit_line)
    finally:
        _state.at_safe_points = False
        give_back()


def exit_says(line: Callable[[], str]) -> None:
    """What an exit at once says, after doing whatever cleanup `line` does."""
    _state.exit_line = line


def stop_requested() -> bool:
    """Whether a stop signal asked for a stop that `check` has yet to raise."""
    return _state.requested is not None


def check() -> None:
    """A safe point: raise KeyboardInterrupt if a stop signal asked for a stop."""
    if _state.requested is not None:
        raise KeyboardInterrupt


@contextlib.contextmanager
def held():
    """An exit at once waits until the block is done: files written together stay together."""
    with _state.hold:
        yield


def exit_interrupted(line: Callable[[], str]) -> None:
    """Say `line` (computed under `held`, so an exit at once cannot say another) and exit with
    code 130. A further signal then exits without a word."""
    with _state.hold:
        _say(line())
        exit_says(lambda: "")
    sys.exit(130)


def end_process(code: int) -> None:
    """Exit with `code` once the output is flushed and atexit's functions (wandb's, JAX's) have
    run, skipping the interpreter's teardown: it takes seconds with XLA's threads still
    running, has been seen to crash, and a signal arriving during it would find Python's
    default handlers back."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def keep_pending_across_exec() -> None:
    """Just before os.execv: the stop signals are blocked, so one that arrives during the
    restart waits, pending, for the new program to take them over; and a stop already asked
    for is sent again, to be pending there too."""
    _state.handing_over = threading.get_ident()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if _state.requested is not None:
        signal.pthread_kill(_state.handing_over, _state.requested)


_IMPORTLIB = ("importlib", "_frozen_importlib")  # the import system's frames between


def _imported_by_a_script() -> bool:
    """Whether the code importing this module runs as a script's __main__ (not a notebook,
    whose cells have no __file__, and not another module)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_IMPORTLIB):
        frame = frame.f_back
    importer = frame.f_globals if frame is not None else {}
    return importer.get("__name__") == "__main__" and "__file__" in importer


if _imported_by_a_script():
    exit_at_once_on_stop_signals()
