"""The golden runs (tests/golden_runs.py) reproduce their recorded numbers: every metrics.csv
value and every computed summary.json entry, bit for bit where the processor and XLA flags are
the recording ones."""

import json

import numpy as np
import pytest

from tests.golden_runs import (
    GOLDEN_DIR,
    RECORDED,
    RUNS,
    SUMMARY_KEYS,
    read_columns,
    recording_conditions,
    train,
)

RECORD = json.loads(RECORDED.read_text())

# On another processor XLA picks other kernels and float rounding drifts through training.
# AlphaZero's convolutions drift the most: on a processor with AVX-512 its losses differ from
# the recording by 2e-4 relative after four iterations, while every game outcome stays equal.
FOREIGN_RTOL = {"az_tic_tac_toe": 2e-3}


def as_numbers(values):
    """Text or JSON values (null for NaN) as a float array."""
    return np.array([np.nan if v in (None, "") else float(v) for v in values])


@pytest.mark.parametrize("name", sorted(RUNS))
def test_golden_run_reproduces_its_recorded_numbers(name, tmp_path):
    exact = recording_conditions() == RECORD["conditions"]
    tolerance = (
        dict(rtol=0, atol=0) if exact else dict(rtol=FOREIGN_RTOL.get(name, 1e-5), atol=1e-6)
    )
    assert RECORD["runs"][name]["flags"] == RUNS[name][1], "re-record after changing the flags"
    summary, columns = train(name, str(tmp_path))
    recorded = read_columns(GOLDEN_DIR / f"{name}.csv")
    assert list(columns) == list(recorded)
    for column, values in recorded.items():
        np.testing.assert_allclose(
            as_numbers(columns[column]), as_numbers(values), **tolerance, err_msg=column
        )
    for key in SUMMARY_KEYS:
        got, want = summary[key], RECORD["runs"][name][key]
        if key == "final_metrics_per_seed":
            assert [sorted(d) for d in got] == [sorted(d) for d in want]
            got = [d[k] for d in got for k in sorted(d)]
            want = [d[k] for d in want for k in sorted(d)]
        np.testing.assert_allclose(as_numbers(got), as_numbers(want), **tolerance, err_msg=key)
