"""Layers in utils/ compute exactly what the flax layer they replace computes."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from utils.layers import Conv3x3


@pytest.mark.parametrize("matmul", [True, False])
def test_conv3x3_equals_flax_conv(matmul):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 10, 10, 4))  # extra batch dims too
    ours = Conv3x3(16, matmul=matmul)
    params = ours.init(jax.random.PRNGKey(1), x)
    reference = nn.Conv(16, (3, 3), padding="SAME")
    # The same parameters, and the same initial values as flax's conv.
    flax_params = reference.init(jax.random.PRNGKey(1), x)
    jax.tree.map(np.testing.assert_array_equal, params, flax_params)
    expected = reference.apply(params, x)
    np.testing.assert_allclose(ours.apply(params, x), expected, rtol=1e-5, atol=1e-5)


def test_conv3x3_under_vmapped_parameters():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 6, 7, 2))  # 3 seeds
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    params = jax.vmap(Conv3x3(8).init)(keys, x)
    fast = jax.vmap(Conv3x3(8, matmul=True).apply)(params, x)
    plain = jax.vmap(Conv3x3(8, matmul=False).apply)(params, x)
    np.testing.assert_allclose(fast, plain, rtol=1e-5, atol=1e-5)
