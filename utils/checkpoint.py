"""Atomic checkpoints of the whole training state with orbax.

Each checkpoint is a directory `checkpoints/update_XXXXXXXX`. Orbax writes it under a
temporary name and renames it when complete, so a crash mid-write leaves the previous
checkpoint intact; older checkpoints are deleted only after the new one is in place.
Ctrl-C or SIGTERM during a write is held back until the write has finished.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp

from utils.errors import ConfigError

_NAME = re.compile(r"^update_(\d{8})$")


_deferring = False


# The signals that stop a run: Ctrl-C, and SIGTERM, which SLURM and Kubernetes send first.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _raise_interrupt(*_):
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals_interrupt():
    """Inside the block, SIGTERM raises KeyboardInterrupt as Ctrl-C does, so that a run stopped
    by its scheduler saves a checkpoint and says how to resume."""
    try:
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def defer_interrupts():
    """Hold a Ctrl-C or SIGTERM that arrives inside the block and raise KeyboardInterrupt once
    the block is done.

    Nested blocks defer to the outermost one, so the interrupt surfaces only when all the
    work they guard has finished.
    """
    global _deferring
    if _deferring:
        yield
        return
    received = []
    try:
        previous = {s: signal.signal(s, lambda *_: received.append(True)) for s in STOP_SIGNALS}
    except ValueError:  # not the main thread: signals cannot be caught here anyway
        yield
        return
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        for stop_signal, handler in previous.items():
            signal.signal(stop_signal, handler)
        if received:
            raise KeyboardInterrupt


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


def save(directory: str, update: int, state, meta: dict) -> str:
    """Write `state` (any pytree) and `meta` (numbers) as the checkpoint after `update`."""
    leaves = jax.device_get(jax.tree.leaves(state))
    tree = {
        "leaves": {f"{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)},
        "meta": {k: np.asarray(v) for k, v in meta.items()},
    }
    path = os.path.join(os.path.abspath(directory), f"update_{update:08d}")
    with defer_interrupts():
        if not os.path.exists(path):
            _checkpointer().save(path, tree)
        for _, name in _checkpoints(directory):
            if name != os.path.basename(path):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return path


def _checkpointer() -> ocp.Checkpointer:
    """Orbax's PyTree checkpointer, told that process 0 saves alone: in a multi-process run
    the other processes never call it, and by default orbax would wait for them."""
    alone = ocp.options.MultiprocessingOptions(primary_host=0, active_processes={0})
    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(multiprocessing_options=alone),
        multiprocessing_options=alone,
    )


def latest_update(directory: str) -> int | None:
    found = _checkpoints(directory)
    return found[-1][0] if found else None


def restore(directory: str, template):
    """Load the latest checkpoint into the structure of `template`: returns (state, meta)."""
    found = _checkpoints(directory)
    if not found:
        raise ConfigError(f"--resume: no checkpoint found in {directory!r}")
    tree = _checkpointer().restore(os.path.join(os.path.abspath(directory), found[-1][1]))
    template_leaves, treedef = jax.tree.flatten(template)
    leaves = [tree["leaves"][f"{i:05d}"] for i in range(len(tree["leaves"]))]
    shapes_match = len(leaves) == len(template_leaves) and all(
        np.shape(a) == np.shape(b) for a, b in zip(leaves, template_leaves, strict=False)
    )
    if not shapes_match:
        raise ConfigError(
            f"--resume: the checkpoint in {directory!r} does not match this config's state "
            "(different devices, seeds or network?)"
        )
    meta = {k: v.item() for k, v in tree["meta"].items()}
    return jax.tree.unflatten(treedef, leaves), meta
