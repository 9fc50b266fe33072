"""Layers that compute what a standard flax layer computes, only faster where it matters."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class Conv3x3(nn.Module):
    """`nn.Conv(features, (3, 3))` with 'SAME' padding: same parameters, same function, and a
    choice of how XLA computes it.

    `matmul=True` writes the convolution as nine shifted copies of the input and one matmul.
    Use it when the parameters are vmapped (several seeds in one program): JAX turns a
    convolution with batched parameters into a grouped convolution, which XLA:CPU runs 2-5x
    slower than the matmul form. With unbatched parameters XLA's own convolution is the faster
    one (1.4-2x forward, 2-4x with the backward pass, at board and MinAtar sizes), so
    `matmul=False` calls it.
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
