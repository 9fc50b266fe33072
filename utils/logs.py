"""Metric sinks: metrics.csv (always) and Weights & Biases (with --track); JSON reports."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import sys
import warnings

import numpy as np

from utils.errors import ConfigError


class MetricsCsv:
    """metrics.csv with one row per update and run. A run is named by `run_columns` (its seed
    index, and when sweeping its configuration index and hyperparameter values), one list entry
    per run. On resume, rows past the checkpoint go."""

    def __init__(
        self,
        path: str,
        run_columns: dict[str, list],
        metric_names: list[str],
        keep_until_update: int | None = None,
    ):
        self.path = path
        self.run_values = list(zip(*run_columns.values(), strict=True))
        self.metric_names = metric_names
        self.columns = ["update", "env_steps", *run_columns, *metric_names]
        if keep_until_update is not None and os.path.exists(path):
            self._rewrite(_complete_rows(path, keep_until_update))
        elif not os.path.exists(path):
            self._rewrite([])

    def _rewrite(self, rows: list[dict]):
        tmp = self.path + ".tmp"
        with naming_the_file(self.path), open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def append(self, first_update: int, steps_per_update: int, metrics: dict[str, np.ndarray]):
        """`metrics[name]` has shape [num_runs, num_updates]; update numbers start at 1. The
        chunk's rows go out in one write, flushed, so a crash leaves at most a torn last line,
        which a resume drops."""
        num_updates = next(iter(metrics.values())).shape[1]
        text = io.StringIO()
        writer = csv.writer(text)
        for k in range(num_updates):
            update = first_update + k
            for run, run_values in enumerate(self.run_values):
                values = [float(metrics[name][run, k]) for name in self.metric_names]
                writer.writerow([update, update * steps_per_update, *run_values, *values])
        with naming_the_file(self.path), open(self.path, "a", newline="") as f:
            f.write(text.getvalue())
            f.flush()


def _complete_rows(path: str, keep_until_update: int) -> list[dict]:
    """The rows of metrics.csv up to the checkpoint's update. A row that a crash or a full disk
    cut short (fewer fields, an empty or unparsable value, no line end) goes, with a note."""
    with open(path, newline="") as f:
        lines = f.read().splitlines(keepends=True)
    header = next(csv.reader(lines[:1]), [])
    rows, torn = [], 0
    for line in lines[1:]:
        fields = next(csv.reader([line]), [])
        complete = line.endswith("\n") and len(fields) == len(header) and _all_numbers(fields)
        if not complete:
            torn += 1
        elif int(fields[0]) <= keep_until_update:
            rows.append(dict(zip(header, fields, strict=True)))
    if torn:
        print(f"note: dropped {torn} incomplete row(s) of {path}", file=sys.stderr)
    return rows


def _all_numbers(fields: list[str]) -> bool:
    """Every column of metrics.csv is a number; "" is a value that a crash cut off."""
    try:
        for value in fields:
            float(value)
    except ValueError:
        return False
    return True


def read_metrics_csv(path: str) -> dict[str, np.ndarray]:
    """Columns of metrics.csv as float64 arrays ({} for a file without rows). NumPy's parser:
    a run of many seeds has millions of rows."""
    with open(path, newline="") as f, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "loadtxt: input contained no data")
        header = next(csv.reader(f), [])
        rows = np.loadtxt(f, delimiter=",", dtype=np.float64, ndmin=2)
    if not len(rows):
        return {}
    return {name: rows[:, i] for i, name in enumerate(header)}


# wandb's charts draw about 1,000 points of a curve, and a `wandb.log` call per update can
# take longer than the update (docs/benchmarks.md): a run sends at most this many points, each
# the mean of consecutive updates (metrics.csv keeps every update).
WANDB_POINTS = 1000


class WandbSink:
    """One curve per run for the headline metric (the episode return unless the trainer says
    otherwise), named by `run_labels`, plus the mean over runs of every metric. A point is the
    mean of `stride` consecutive updates of a chunk (1 for runs of at most WANDB_POINTS
    updates), logged at the env steps of the last of them."""

    def __init__(
        self,
        config,
        run_dir: str,
        run_name: str,
        headline_metric: str,
        run_labels: list[str],
        num_updates: int,
    ):
        self.headline_metric = headline_metric
        self.run_labels = run_labels
        self.stride = max(1, math.ceil(num_updates / WANDB_POINTS))
        import wandb  # imported only when tracking, so wandb is never needed otherwise

        self.run = wandb.init(
            project=config.wandb_project_name,
            entity=config.wandb_entity,
            name=run_name,
            id=run_name.replace("/", "_"),
            resume="allow",
            config=dataclasses.asdict(config),
            dir=run_dir,
        )

    def log(self, first_update: int, steps_per_update: int, metrics: dict[str, np.ndarray]):
        """`metrics[name]` has shape [num_runs, num_updates], as MetricsCsv.append takes it."""
        num_updates = next(iter(metrics.values())).shape[1]
        for start in range(0, num_updates, self.stride):
            window = slice(start, start + self.stride)
            row = {
                f"{name}/mean": _finite_mean(values[:, window]) for name, values in metrics.items()
            }
            headline = metrics[self.headline_metric][:, window]
            for label, values in zip(self.run_labels, headline, strict=True):
                row[f"{self.headline_metric}/{label}"] = _finite_mean(values)
            last_update = first_update + min(start + self.stride, num_updates) - 1
            row = {k: v for k, v in row.items() if v is not None}
            self.run.log(row, step=last_update * steps_per_update)

    def log_video(self, path: str):
        import wandb

        self.run.log({"video/final": wandb.Video(path, format="gif")})

    def log_files(self, step: int, paths: list[str]):
        """SVG game records, shown as HTML panels named after the file."""
        import wandb

        row = {}
        for path in paths:
            with open(path) as f:
                row[f"games/{os.path.splitext(os.path.basename(path))[0]}"] = wandb.Html(f.read())
        self.run.log(row, step=step)

    def finish(self, summary: dict):
        self.run.summary.update({k: v for k, v in summary.items() if not isinstance(v, list)})
        self.run.finish()


def _finite_mean(values: np.ndarray) -> float | None:
    """The mean of the finite entries, None where there are none (nothing reported)."""
    finite = values[np.isfinite(values)]
    return float(finite.mean()) if finite.size else None


def _strict_json(value):
    """`value` with every non-finite float as None: Python writes NaN and Infinity, which strict
    JSON readers (jq, JavaScript, most other languages) reject; null is what they all read."""
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: str, data) -> None:
    """`data` as strict JSON at `path`, written whole or not at all (a temporary file, renamed)."""
    tmp = path + ".tmp"
    with naming_the_file(path):
        with open(tmp, "w") as f:
            json.dump(_strict_json(data), f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)


def read_json(path: str, flag: str) -> dict:
    """The JSON object at `path`, which `flag` reads. A file that is cut short (a crash, a full
    disk), not JSON, not an object or unreadable is a ConfigError that names it."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as error:
        raise ConfigError(f"{flag}: cannot read {path}: {error.strerror}") from None
    except ValueError as error:  # not JSON, or bytes that are not UTF-8
        raise ConfigError(f"{flag}: {path} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


@contextlib.contextmanager
def naming_the_file(path: str):
    """An OSError in the block names `path` if it names no file: a disk that fills up fails a
    write, flush or close with only the error."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), path) from error
