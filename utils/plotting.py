"""Learning-curve plot from metrics.csv."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only: never needs a display
import matplotlib.pyplot as plt
import numpy as np

from utils.logs import read_metrics_csv


def plot_learning_curve(
    csv_path: str,
    png_path: str,
    title: str,
    metric: str = "episode_return",
    step_unit: str = "steps",
) -> None:
    """Mean of `metric` across seeds vs env steps, with the min-max band across seeds."""
    columns = read_metrics_csv(csv_path)
    fig, ax = plt.subplots(figsize=(6, 4))
    if columns:
        steps = np.unique(columns["env_steps"])
        by_step = [columns[metric][columns["env_steps"] == s] for s in steps]
        has_value = np.array([np.isfinite(v).any() for v in by_step])
        steps = steps[has_value]
        by_step = [v[np.isfinite(v)] for v, ok in zip(by_step, has_value, strict=True) if ok]
        if by_step:
            mean = np.array([v.mean() for v in by_step])
            ax.fill_between(
                steps, [v.min() for v in by_step], [v.max() for v in by_step], alpha=0.25
            )
            num_seeds = int(columns["seed"].max()) + 1
            ax.plot(steps, mean, label=f"mean of {num_seeds} seed(s), band: min-max")
            ax.legend(loc="lower right")
    ax.set_xlabel(f"environment {step_unit}")
    ax.set_ylabel(metric.replace("_", " "))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
