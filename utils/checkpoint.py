"""Atomic checkpoints of the whole training state, as one uncompressed NumPy archive.

Each checkpoint is a directory `checkpoints/update_XXXXXXXX` holding `state.npz`: the state's
leaves in its flattening order (`leaf_00000`, ...), the name of each leaf's dtype (so that
bfloat16 and other ml_dtypes types read back as themselves) and the meta numbers
(`meta_<name>`). It is written under a temporary name, flushed to disk and renamed when
complete, so a crash mid-write leaves the previous checkpoint intact; older checkpoints are
deleted only after the new one is in place (all but the newest `keep`: the driver's
--keep-checkpoints, by default the newest alone). Ctrl-C or SIGTERM during a write lets the
write finish (utils/interrupts.py). A save takes about a millisecond plus the state's bytes
over the disk's speed; the driver saves after the chunks its schedule picks (`_Checkpoints`
in utils/driver.py). Checkpoints written by earlier versions with orbax still read back.
"""

from __future__ import annotations

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np

from utils import interrupts
from utils.errors import ConfigError

_NAME = re.compile(r"^update_(\d{8})$")
_FILE = "state.npz"
_TEMPORARY = ".tmp"


def _checkpoints(directory: str) -> list[tuple[int, str]]:
    if not os.path.isdir(directory):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(directory) if (m := _NAME.match(name))]
    return sorted(found)


def save(directory: str, update: int, state, meta: dict, keep: int = 1) -> str:
    """Write `state` (any pytree) and `meta` (numbers) as the checkpoint after `update`, then
    delete all but the newest `keep` checkpoints (0: delete none)."""
    leaves = [np.asarray(leaf) for leaf in jax.device_get(jax.tree.leaves(state))]
    arrays = {f"leaf_{i:05d}": leaf for i, leaf in enumerate(leaves)}
    arrays["dtypes"] = np.array([leaf.dtype.name for leaf in leaves], dtype=str)
    arrays.update({f"meta_{k}": np.asarray(v) for k, v in meta.items()})
    path = os.path.join(os.path.abspath(directory), f"update_{update:08d}")
    with interrupts.held():
        if not os.path.exists(path):
            _write(path, arrays)
        found = _checkpoints(directory)
        for _, name in found[: -keep if keep else 0]:
            if name != os.path.basename(path):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return path


def _write(path: str, arrays: dict[str, np.ndarray]) -> None:
    """`arrays` as `path`/state.npz, all or nothing: written into `path`.tmp, flushed to the
    disk, then renamed to `path`. On failure the temporary directory is removed and the OSError
    (a full disk, a file size limit) names `path`."""
    temporary = path + _TEMPORARY
    shutil.rmtree(temporary, ignore_errors=True)  # left by a write that was killed
    try:
        os.makedirs(temporary)
        with open(os.path.join(temporary, _FILE), "wb") as file:
            np.savez(file, allow_pickle=False, **arrays)
            file.flush()
            os.fsync(file.fileno())
        os.rename(temporary, path)
    except OSError as error:
        shutil.rmtree(temporary, ignore_errors=True)
        raise OSError(error.errno, error.strerror, path) from None
    _sync_directory(os.path.dirname(path))


def _sync_directory(directory: str) -> None:
    """Make a rename in `directory` durable."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


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
    path = os.path.join(os.path.abspath(directory), name)
    if not os.path.exists(os.path.join(path, _FILE)):
        return _read_orbax(path)
    with np.load(os.path.join(path, _FILE), allow_pickle=False) as archive:
        dtypes = [str(dtype) for dtype in archive["dtypes"]]
        leaves = [_as_dtype(archive[f"leaf_{i:05d}"], dtype) for i, dtype in enumerate(dtypes)]
        meta = {
            k[len("meta_") :]: archive[k].item() for k in archive.files if k.startswith("meta_")
        }
    return leaves, meta


def _as_dtype(array: np.ndarray, name: str) -> np.ndarray:
    """An array read back with its saved dtype: NumPy stores the ml_dtypes types (bfloat16,
    float8, ...) as raw bytes."""
    return array.view(jnp.dtype(name)) if array.dtype.kind == "V" else array


def _read_orbax(path: str) -> tuple[list[np.ndarray], dict]:
    """A checkpoint that an earlier version wrote with orbax."""
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().restore(path)
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
            "(different devices, seeds or network, or written by a version of the trainer "
            "that kept its state in other shapes?)"
        )
    return jax.tree.unflatten(treedef, leaves), meta
