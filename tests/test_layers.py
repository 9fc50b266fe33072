"""Layers in utils/ compute exactly what the flax layer they replace computes."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from utils.layers import Conv3x3


@pytest.mark.parametrize("method", ["matmul", "xla", "dense"])
@pytest.mark.parametrize("board", [(10, 10), (3, 3), (6, 7)])
def test_conv3x3_equals_flax_conv(method, board):
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, *board, 4))  # extra batch dims too
    ours = Conv3x3(16, method=method)
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
    plain = jax.vmap(Conv3x3(8, method="xla").apply)(params, x)
    for method in ("matmul", "dense"):
        ours = jax.vmap(Conv3x3(8, method=method).apply)(params, x)
        np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-5)


def test_conv3x3_dense_gradient_equals_flax_conv():
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 3, 2))
    params = Conv3x3(8).init(jax.random.PRNGKey(1), x)

    def loss(method):
        return lambda p: (Conv3x3(8, method=method).apply(p, x) ** 2).sum()

    dense, plain = jax.grad(loss("dense"))(params), jax.grad(loss("xla"))(params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), dense, plain)


def test_conv3x3_unknown_method():
    with pytest.raises(ValueError, match="matmul, dense or xla"):
        Conv3x3(8, method="fft").init(jax.random.PRNGKey(0), np.zeros((1, 3, 3, 2)))
