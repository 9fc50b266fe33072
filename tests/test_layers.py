"""Layers in utils/ compute exactly what the flax layer they replace computes."""

import flax.linen as nn
import jax
import numpy as np

from utils.layers import Conv3x3


def test_conv3x3_equals_flax_conv():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 10, 10, 4))  # extra batch dims too
    ours = Conv3x3(16, kernel_init=nn.initializers.lecun_normal())
    params = ours.init(jax.random.PRNGKey(1), x)
    dense = params["params"]["Dense_0"]
    reference = nn.Conv(16, (3, 3), padding="SAME")
    # Our patches are ordered (row offset, column offset, channel): the conv kernel's layout.
    kernel = dense["kernel"].reshape(3, 3, 4, 16)
    expected = reference.apply({"params": {"kernel": kernel, "bias": dense["bias"]}}, x)
    np.testing.assert_allclose(ours.apply(params, x), expected, rtol=1e-5, atol=1e-5)
