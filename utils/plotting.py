"""Learning-curve plot from metrics.csv. matplotlib is imported when a run first plots, not
before the run starts (docs/benchmarks.md, "What a run does between chunks")."""

from __future__ import annotations

import numpy as np


def plot_learning_curve(
    columns: dict[str, np.ndarray],
    png_path: str,
    title: str,
    metric: str = "episode_return",
    step_unit: str = "steps",
    config_labels: list[str] | None = None,
) -> None:
    """Mean of `metric` across seeds vs env steps, with the min-max band across seeds: one
    line and band per sweep configuration when `config_labels` names them. `columns` are
    metrics.csv's (`utils.logs.read_metrics_csv`)."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if columns:
        config_of_row = columns.get("config", np.zeros_like(columns["update"]))
        num_seeds = int(columns["seed"].max()) + 1
        for config in np.unique(config_of_row):
            of_config = config_of_row == config
            label = f"mean of {num_seeds} seed(s), band: min-max"
            if config_labels is not None:
                label = f"{config_labels[int(config)]} ({num_seeds} seeds)"
            _plot_band(ax, columns["env_steps"][of_config], columns[metric][of_config], label)
        if ax.lines:
            ax.legend(loc="best", fontsize="small" if config_labels else None)
    ax.set_xlabel(f"environment {step_unit}")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def _plot_band(ax, env_steps: np.ndarray, values: np.ndarray, label: str) -> None:
    """Mean over the rows at each step, and their min-max band; steps without a finite value
    are skipped. One pass over the rows: a run of many seeds has millions."""
    steps, step_of_row = np.unique(env_steps, return_inverse=True)
    finite = np.isfinite(values)
    step_of_value, values = step_of_row[finite], values[finite]
    count = np.bincount(step_of_value, minlength=len(steps))
    total = np.bincount(step_of_value, weights=values, minlength=len(steps))
    low, high = np.full(len(steps), np.inf), np.full(len(steps), -np.inf)
    np.minimum.at(low, step_of_value, values)
    np.maximum.at(high, step_of_value, values)
    has_value = count > 0
    if has_value.any():
        steps = steps[has_value]
        (line,) = ax.plot(steps, total[has_value] / count[has_value], label=label)
        ax.fill_between(steps, low[has_value], high[has_value], alpha=0.25, color=line.get_color())
