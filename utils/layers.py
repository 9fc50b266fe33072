"""Layers and initialisers that compute what flax's compute, only faster or safer where it
matters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


def orthogonal(scale: float = 1.0, column_axis: int = -1, dtype=jnp.float32):
    """`nn.initializers.orthogonal`, the same numbers, with its QR decomposition never batched:
    under `jax.vmap` (seeds in one program, PureJaxRL's `jax.jit(jax.vmap(train))`) the
    matrices are drawn one after another. XLA:CPU runs a batched QR by spreading the matrices
    over its intra-op thread pool and waiting for them from inside that pool, which deadlocked
    a 2-core host: every pool thread waiting, the program never finishing."""
    init = nn.initializers.orthogonal(scale, column_axis, dtype)

    def orthogonal_init(key, shape, dtype=dtype):
        return jax.custom_batching.sequential_vmap(lambda key: init(key, shape, dtype))(key)

    return orthogonal_init


class Conv3x3(nn.Module):
    """`nn.Conv(features, (3, 3))` with 'SAME' padding: same parameters, same function, and a
    choice of how XLA computes it (`method`):

    - "matmul" (the default) writes the convolution as nine shifted copies of the input and
      one matmul. XLA:CPU is fast at it everywhere. Its own convolution is slow with vmapped
      parameters (several seeds in one program), where JAX makes it a grouped convolution.
    - "xla" calls XLA's convolution (`conv3x3_same`), faster with unbatched parameters (one
      seed), for a forward pass and an SGD step.
    - "dense" multiplies the flattened board by one [height*width*channels, height*width*
      features] matrix gathered from the kernel. On a board of at most 3x3 every output sees
      the whole board, so this is the convolution's own arithmetic in one matmul: faster than
      both others for a tic_tac_toe forward pass on CPU while a core is idle (XLA then runs
      the one matmul on two); with one device per core, every core busy, "xla" (one seed)
      and "matmul" (vmapped seeds) search faster. Larger boards pay height*width/9 times the
      arithmetic: slower there.

    The measurements are in docs/benchmarks.md, "Convolutions on XLA:CPU".
    """

    features: int
    method: str = "matmul"
    kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()

    @nn.compact
    def __call__(self, x):  # [..., height, width, channels]
        channels = x.shape[-1]
        kernel = self.param("kernel", self.kernel_init, (3, 3, channels, self.features))
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        height, width = x.shape[-3:-1]
        if self.method == "matmul":
            padded = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(1, 1), (1, 1), (0, 0)])
            # Patches ordered (row offset, column offset, channel): the kernel's own layout.
            patches = jnp.concatenate(
                [padded[..., i : i + height, j : j + width, :] for i in range(3) for j in range(3)],
                axis=-1,
            )
            return patches @ kernel.reshape(9 * channels, self.features) + bias
        if self.method == "dense":
            taps = jnp.concatenate(
                [kernel.reshape(9, channels, self.features), jnp.zeros_like(kernel[:1, 0])]
            )
            # [in position, out position, in channel, out channel] -> rows (in position, in
            # channel), columns (out position, out channel): the flattened board's layouts.
            dense = taps[dense_tap_index(height, width)].transpose(0, 2, 1, 3)
            flat = x.reshape(*x.shape[:-3], height * width * channels)
            y = flat @ dense.reshape(height * width * channels, height * width * self.features)
            return y.reshape(*x.shape[:-3], height, width, self.features) + bias
        if self.method != "xla":
            raise ValueError(f"Conv3x3 method must be matmul, dense or xla, got {self.method!r}")
        batch_shape = x.shape[:-3]
        y = conv3x3_same(x.reshape(-1, *x.shape[-3:]), kernel)
        return y.reshape(*batch_shape, *y.shape[1:]) + bias


_NHWC = ("NHWC", "HWIO", "NHWC")  # XLA:CPU's own fast form: its runtime calls Eigen for it


@jax.custom_vjp
def conv3x3_same(x, kernel):
    """XLA's convolution of x [N, H, W, C] with kernel [3, 3, C, F], 'SAME' padding -> [N, H,
    W, F], whose gradient is two more convolutions of the same form. JAX's own gradient writes
    them in other dimension orders; outside a loop XLA:CPU transposes them back to the form
    its runtime computes fast, inside one (SGD steps in a `lax.scan`) it does not and runs
    them many times slower (docs/benchmarks.md, "Convolutions on XLA:CPU"). Reverse mode only,
    as any `jax.custom_vjp`: `jax.jvp` through it raises."""
    return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=_NHWC)


def _conv3x3_forward(x, kernel):
    return conv3x3_same(x, kernel), (x, kernel)


def _conv3x3_backward(residuals, dy):
    x, kernel = residuals
    # d/dx: dy convolved with the kernel turned 180 degrees, its channel axes swapped
    dx = conv3x3_same(dy, jnp.flip(kernel, (0, 1)).transpose(0, 1, 3, 2))
    # d/dkernel: a convolution over the batch, with x's channels as its batch ([C, H, W,
    # N]) and dy as its [H, W, N, F] kernel, over x padded by one on each side -> [C, 3, 3, F]
    dkernel = jax.lax.conv_general_dilated(
        x.transpose(3, 1, 2, 0),
        dy.transpose(1, 2, 0, 3),
        (1, 1),
        [(1, 1), (1, 1)],
        dimension_numbers=_NHWC,
    )
    return dx, dkernel.transpose(1, 2, 0, 3)


conv3x3_same.defvjp(_conv3x3_forward, _conv3x3_backward)


def dense_tap_index(height: int, width: int) -> np.ndarray:
    """[in position, out position] -> which of the kernel's nine taps (row offset, column
    offset) links them, or 9 (a zero tap) where the input is out of the 3x3 window."""
    index = np.full((height * width, height * width), 9)
    for row in range(height):
        for col in range(width):
            for tap, (dr, dc) in enumerate(np.ndindex(3, 3)):
                r, c = row + dr - 1, col + dc - 1
                if 0 <= r < height and 0 <= c < width:
                    index[r * width + c, row * width + col] = tap
    return index
