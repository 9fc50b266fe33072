"""Device helpers: how many devices a run uses, and the pmap axis name the trainers share."""

import os
import re
import sys

import jax

from utils.errors import ConfigError

# The pmap axis over devices; trainers `pmean` their gradients over it.
DEVICE_AXIS = "device"

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def available_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def split_cpu_host(num_cpu_devices: int) -> None:
    """Give the CPU backend `num_cpu_devices` devices (0: leave it alone, -1: one per core).

    JAX fixes the CPU device count when its backend starts, and importing gymnax or pgx already
    starts it. So when the count differs, the process restarts itself once (same interpreter,
    same arguments) with the XLA flag set. On a GPU or TPU host the flag does nothing.
    """
    if num_cpu_devices < -1:
        raise ConfigError(
            f"--cpu-devices must be >= -1 (0: JAX's default, -1: one per core), got "
            f"{num_cpu_devices}"
        )
    if num_cpu_devices == 0 or jax.default_backend() != "cpu":
        return
    if num_cpu_devices == -1:
        num_cpu_devices = available_cores()
    if jax.local_device_count() == num_cpu_devices:
        return
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", ""))
    if os.environ.get("PUREJAXRL_CPU_DEVICES") == str(num_cpu_devices):
        raise ConfigError(
            f"--cpu-devices {num_cpu_devices}: JAX still shows {jax.local_device_count()} CPU "
            "device(s) after restarting with XLA_FLAGS set; is XLA_FLAGS overridden elsewhere?"
        )
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={num_cpu_devices}".strip()
    os.environ["PUREJAXRL_CPU_DEVICES"] = str(num_cpu_devices)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def resolve_num_devices(requested: int) -> int:
    """`requested` local devices, or all of them for 0; a clear error if there are too few."""
    available = jax.local_device_count()
    if requested < 0:
        raise ConfigError(f"--num-devices must be >= 0 (0 means all), got {requested}")
    if requested > available:
        raise ConfigError(
            f"--num-devices {requested} asks for more devices than the {available} available "
            f"({jax.default_backend()}); on a CPU, --cpu-devices N splits the host into N devices"
        )
    return requested or available
