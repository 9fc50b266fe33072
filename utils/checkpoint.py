"""Atomic checkpoints of the whole training state with orbax.

Each checkpoint is a directory `checkpoints/update_XXXXXXXX`. Orbax writes it under a
temporary name and renames it when complete, so a crash mid-write leaves the previous
checkpoint intact; older checkpoints are deleted only after the new one is in place (all but
the newest `keep`: the driver's --keep-checkpoints, by default the newest alone).
Ctrl-C or SIGTERM during a write lets the write finish (utils/interrupts.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

from utils import interrupts
from utils.errors import ConfigError

_NAME = re.compile(r"^update_(\d{8})$")


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


def save(directory: str, update: int, state, meta: dict, keep: int = 1) -> str:
    """Write `state` (any pytree) and `meta` (numbers) as the checkpoint after `update`, then
    delete all but the newest `keep` checkpoints (0: delete none)."""
    leaves = jax.device_get(jax.tree.leaves(state))
    tree = {
        "leaves": {f"{i:05d}": np.asarray(leaf) for i, leaf in enumerate(leaves)},
        "meta": {k: np.asarray(v) for k, v in meta.items()},
    }
    path = os.path.join(os.path.abspath(directory), f"update_{update:08d}")
    with interrupts.held():
        if not os.path.exists(path):
            with _failure_as_one_os_error(path):
                _checkpointer().save(path, tree)
        found = _checkpoints(directory)
        for _, name in found[: -keep if keep else 0]:
            if name != os.path.basename(path):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return path


# tensorstore reports a failed write (a full disk, a file size limit) as a ValueError that ends
# with the OS error's code
_OS_ERROR_CODE = re.compile(r"\[os_error_code='(\d+)'\]")


@contextlib.contextmanager
def _failure_as_one_os_error(path: str):
    """Orbax's write of the checkpoint `path`, whose failure is one OSError naming it. Orbax's
    worker threads log the failure with its traceback, and tensorstore's callbacks then report
    "Event loop is closed" into loops already gone, many times over, until the process ends:
    their log records are held and dropped if the write fails (emitted if it succeeds), and
    those reports are dropped from then on."""
    absl_logger, held = logging.getLogger("absl"), []

    def hold(record):
        held.append(record)
        return False

    absl_logger.addFilter(hold)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _dropping_closed_loop_reports(previous_hook)
    try:
        yield
    except ValueError as error:
        code = _OS_ERROR_CODE.search(str(error))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from None
    finally:
        absl_logger.removeFilter(hold)
    sys.unraisablehook = previous_hook  # the write succeeded
    for record in held:
        absl_logger.handle(record)


def _dropping_closed_loop_reports(hook):
    """`hook` (a sys.unraisablehook) for every report but tensorstore's closed event loops."""

    def unraisable_hook(unraisable):
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            hook(unraisable)

    return unraisable_hook


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


def updates(directory: str) -> list[int]:
    """The updates of the checkpoints in `directory`, oldest first."""
    return [update for update, _ in _checkpoints(directory)]


def read(directory: str, update: int | None = None) -> tuple[list[np.ndarray], dict]:
    """The checkpoint after `update` (None: the latest) as it is on disk: (its leaves in the
    state's flattening order, meta). The caller checks that it exists (`updates`)."""
    name = dict(_checkpoints(directory))[update if update is not None else updates(directory)[-1]]
    tree = _checkpointer().restore(os.path.join(os.path.abspath(directory), name))
    leaves = [tree["leaves"][f"{i:05d}"] for i in range(len(tree["leaves"]))]
    return leaves, {k: v.item() for k, v in tree["meta"].items()}


def restore(directory: str, template):
    """Load the latest checkpoint into the structure of `template`: returns (state, meta)."""
    if not _checkpoints(directory):
        raise ConfigError(f"--resume: no checkpoint found in {directory!r}")
    leaves, meta = read(directory)
    template_leaves, treedef = jax.tree.flatten(template)
    shapes_match = len(leaves) == len(template_leaves) and all(
        np.shape(a) == np.shape(b) for a, b in zip(leaves, template_leaves, strict=False)
    )
    if not shapes_match:
        raise ConfigError(
            f"--resume: the checkpoint in {directory!r} does not match this config's state "
            "(different devices, seeds or network?)"
        )
    return jax.tree.unflatten(treedef, leaves), meta
