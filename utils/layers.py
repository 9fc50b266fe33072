"""Layers that compute what a standard flax layer computes, only faster where it matters."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class Conv3x3(nn.Module):
    """`nn.Conv(features, (3, 3))` with 'SAME' padding: same parameters, same function, and a
    choice of how XLA computes it.

    `matmul=True` (the default) writes the convolution as nine shifted copies of the input and
    one matmul. XLA:CPU is fast at it everywhere. Its own convolution is slow in two places:
    with vmapped parameters (several seeds in one program) JAX makes it a grouped convolution,
    2-5x slower; and its gradient inside a loop (`lax.scan`) ran about 30x slower than the
    matmul form's. `matmul=False` calls XLA's convolution, 1.2-1.4x faster for a forward pass
    with unbatched parameters, so only for acting, with one seed.
    """

    features: int
    matmul: bool = True
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):  # [..., height, width, channels]
        channels = x.shape[-1]
        kernel = self.param("kernel", self.kernel_init, (3, 3, channels, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        if self.matmul:
            height, width = x.shape[-3:-1]
            padded = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(1, 1), (1, 1), (0, 0)])
            # Patches ordered (row offset, column offset, channel): the kernel's own layout.
            patches = jnp.concatenate(
                [padded[..., i : i + height, j : j + width, :] for i in range(3) for j in range(3)],
                axis=-1,
            )
            return patches @ kernel.reshape(9 * channels, self.features) + bias
        batch_shape = x.shape[:-3]
        y = jax.lax.conv_general_dilated(
            x.reshape(-1, *x.shape[-3:]),
            kernel,
            window_strides=(1, 1),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        return y.reshape(*batch_shape, *y.shape[1:]) + bias
