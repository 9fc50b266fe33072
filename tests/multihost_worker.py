"""One process of the multi-process test: trains PPO like `purejaxrl_ppo.py` with the same
flags, then saves this process's final network parameters (device 0, run 0) to an .npz file.

    python tests/multihost_worker.py OUT.npz [purejaxrl_ppo.py flags...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from purejaxrl_ppo import PRESETS, Config, make_train, validate
from utils.cli import parse_config
from utils.driver import run_training

if __name__ == "__main__":
    out, args = sys.argv[1], sys.argv[2:]
    _, state = run_training(
        parse_config(Config, PRESETS, args), make_train, validate, return_state=True
    )
    np.savez(out, *[np.asarray(leaf[0, 0]) for leaf in jax.tree.leaves(state.params)])
