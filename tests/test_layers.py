"""Layers in utils/ compute exactly what the flax layer they replace computes."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import purejaxrl_ppo
from utils.layers import Conv3x3, conv3x3_same, orthogonal


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


def conv3x3_loop(x, kernel):
    """'SAME' 3x3 convolution as plain loops over a zero-padded board: [N, H, W, C] x [3, 3, C,
    F] -> [N, H, W, F]."""
    n, height, width, _ = x.shape
    padded = np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)])
    y = np.zeros((n, height, width, kernel.shape[-1]))
    for row in range(height):
        for col in range(width):
            for dr in range(3):
                for dc in range(3):
                    y[:, row, col] += padded[:, row + dr, col + dc] @ kernel[dr, dc]
    return y


def test_conv3x3_same_gradient_equals_a_loop_reference():
    """`conv3x3_same` and its own gradient against plain loops: the loss sum(y * dy) is linear
    in x and in the kernel, so each derivative is a sum over the padded board."""
    rng = np.random.default_rng(0)
    x, kernel = rng.normal(size=(3, 6, 7, 2)), rng.normal(size=(3, 3, 2, 4))
    dy = rng.normal(size=(3, 6, 7, 4))
    np.testing.assert_allclose(
        conv3x3_same(jnp.float32(x), jnp.float32(kernel)), conv3x3_loop(x, kernel), atol=1e-4
    )
    dx, dkernel = jax.grad(lambda a, k: jnp.sum(conv3x3_same(a, k) * dy), (0, 1))(
        jnp.float32(x), jnp.float32(kernel)
    )
    # y[n, r, c] sums padded_x[n, r + dr, c + dc] @ kernel[dr, dc]: each term's derivatives
    padded = np.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)])
    expected_dx, expected_dkernel = np.zeros_like(padded), np.zeros_like(kernel)
    for row in range(6):
        for col in range(7):
            for dr in range(3):
                for dc in range(3):
                    expected_dx[:, row + dr, col + dc] += dy[:, row, col] @ kernel[dr, dc].T
                    expected_dkernel[dr, dc] += padded[:, row + dr, col + dc].T @ dy[:, row, col]
    np.testing.assert_allclose(dx, expected_dx[:, 1:-1, 1:-1], atol=1e-4)
    np.testing.assert_allclose(dkernel, expected_dkernel, atol=1e-4)


def compiled_convolution_forms(conv) -> set[str]:
    """The dimension orders of every convolution in XLA:CPU's optimised program of four SGD-like
    steps of `conv`'s gradient in a `lax.scan`."""
    x = jnp.ones((8, 6, 7, 4))

    def step(kernel, _):
        return kernel - 0.1 * jax.grad(lambda k: jnp.sum(conv(x, k) ** 2))(kernel), None

    program = jax.jit(lambda k: jax.lax.scan(step, k, None, 4)[0])
    text = program.lower(jnp.ones((3, 3, 4, 4))).compile().as_text()
    return set(re.findall(r" convolution\(.*?dim_labels=(\S+?),", text))


def test_conv3x3_same_gradient_in_a_loop_keeps_xlas_fast_form():
    """Inside a loop XLA:CPU leaves JAX's own convolution gradient in other dimension orders,
    which it computes many times slower; `conv3x3_same`'s gradient stays in the form its
    runtime calls Eigen for. The plain convolution is the control."""
    assert compiled_convolution_forms(conv3x3_same) == {"b01f_01io->b01f"}

    def plain(x, kernel):
        dimensions = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(x, kernel, (1, 1), "SAME", dimension_numbers=dimensions)

    assert compiled_convolution_forms(plain) - {"b01f_01io->b01f"}


def test_conv3x3_unknown_method():
    with pytest.raises(ValueError, match="matmul, dense or xla"):
        Conv3x3(8, method="fft").init(jax.random.PRNGKey(0), np.zeros((1, 3, 3, 2)))


# ---------------------------------------------------------------------------------------------
# Orthogonal initialisation under vmap
# ---------------------------------------------------------------------------------------------


def qr_operand_shapes(jaxpr) -> list[tuple[int, ...]]:
    """The operand shapes of every QR decomposition in a jaxpr, its sub-jaxprs included."""
    shapes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "qr":
            shapes.append(eqn.invars[0].aval.shape)
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    shapes += qr_operand_shapes(inner)
    return shapes


@pytest.mark.parametrize("memory", ["none", "gru"])
def test_ppo_trained_as_purejaxrl_does_never_batches_a_qr(memory):
    """`jax.jit(jax.vmap(train))` over seeds: every orthogonal initialisation's QR is one
    matrix, since XLA:CPU's batched QR deadlocked a 2-core host. flax's own initialiser, the
    control, batches it."""
    trainer = purejaxrl_ppo.make_train(purejaxrl_ppo.Config(memory=memory, num_minibatches=2))
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    shapes = qr_operand_shapes(jax.make_jaxpr(jax.vmap(trainer.train))(keys).jaxpr)
    assert shapes and all(len(shape) == 2 for shape in shapes), shapes
    flax_init = nn.initializers.orthogonal()
    control = jax.make_jaxpr(jax.vmap(lambda key: flax_init(key, (4, 64))))(keys).jaxpr
    assert qr_operand_shapes(control) == [(2, 64, 4)]


def test_orthogonal_draws_flaxs_numbers_one_matrix_at_a_time():
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    for shape, scale in (((4, 64), np.sqrt(2)), ((64, 2), 0.01), ((3, 3, 2, 16), 1.0)):
        ours = jax.vmap(lambda key, s=shape, c=scale: orthogonal(c)(key, s))(keys)
        flax = jax.vmap(lambda key, s=shape, c=scale: nn.initializers.orthogonal(c)(key, s))(keys)
        np.testing.assert_array_equal(ours, flax)
