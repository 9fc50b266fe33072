"""Device helpers: how many devices a run uses, and the pmap axis name the trainers share."""

import jax

from utils.errors import ConfigError

# The pmap axis over devices; trainers `pmean` their gradients over it.
DEVICE_AXIS = "device"


def resolve_num_devices(requested: int) -> int:
    """`requested` local devices, or all of them for 0; a clear error if there are too few."""
    available = jax.local_device_count()
    if requested < 0:
        raise ConfigError(f"--num-devices must be >= 0 (0 means all), got {requested}")
    if requested > available:
        raise ConfigError(
            f"--num-devices {requested} asks for more devices than the {available} available "
            f"({jax.default_backend()}); on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "splits the host into N devices"
        )
    return requested or available
