"""Device helpers: how many devices a run uses, and the pmap axis name the trainers share."""

import json
import os
import re
import runpy
import sys

import jax

from utils import interrupts
from utils.errors import ConfigError

# The pmap axis over devices; trainers average their gradients over it with `device_mean`.
DEVICE_AXIS = "device"


def device_sum(tree):
    """`psum` over DEVICE_AXIS. With one device it is the identity: XLA would still run a
    one-device all-reduce, a measurable cost in a small DQN update (docs/benchmarks.md). The
    axis size is global, so with one device in each of several processes the sum still spans
    them."""
    if jax.lax.axis_size(DEVICE_AXIS) == 1:
        return tree
    return jax.lax.psum(tree, DEVICE_AXIS)


def device_mean(tree):
    """`pmean` over DEVICE_AXIS, the identity with one device (see `device_sum`)."""
    if jax.lax.axis_size(DEVICE_AXIS) == 1:
        return tree
    return jax.lax.pmean(tree, DEVICE_AXIS)


_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def available_cores() -> int:
    """CPU cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# XLA:CPU's LLVM optimisation level, 0-3 (XLA's default: 3). XLA reads XLA_FLAGS once, when
# JAX first initialises its backend: importing gymnax does, so a process that sets the flag
# must do so before that import.
LLVM_LEVEL_FLAG = "--xla_backend_optimization_level"


def compile_for_one_call(
    lowered: jax.stages.Lowered, *, simple_kernels: bool = False
) -> jax.stages.Compiled:
    """Compile a program that runs once per run (the initial state, the evaluation after
    training). On CPU it compiles at LLVM optimisation level 0, about twice as fast
    (docs/benchmarks.md), while the program runs for milliseconds. Its floating-point results
    may differ from level 3's in the last bit. `simple_kernels` also emits the fused kernels
    with XLA:CPU's older emitter (`xla_cpu_use_fusion_emitters` off): it compiles faster and
    its kernels run slower (docs/benchmarks.md), so it suits a program that runs for a few
    milliseconds whatever its kernels (the initial state), not one that loops over env steps
    (the evaluation)."""
    if jax.default_backend() != "cpu":
        return lowered.compile()
    options = {LLVM_LEVEL_FLAG.removeprefix("--"): 0}
    if simple_kernels:
        options["xla_cpu_use_fusion_emitters"] = False
    return lowered.compile(compiler_options=options)


def unroll_threefry_on_cpu(unrolled: bool = True) -> None:
    """Lower JAX's threefry random-number hash on CPU as straight-line code (`unrolled`), the
    form JAX uses on GPU and TPU, instead of the five-round loop it emits on CPU to save compile
    time. The bits are the same; each random call becomes a few fused kernels instead of a
    loop of small ones. Compilation takes longer, and neither PPO, DQN nor AlphaZero trains
    faster with it, so they keep JAX's default (`Trainer.unrolled_threefry`). The figures are
    in docs/benchmarks.md. This uses JAX internals (pinned in requirements.txt;
    tests/test_devices.py checks them). It applies to programs lowered afterwards;
    `unrolled=False` restores JAX's CPU default."""
    from jax._src.interpreters import mlir
    from jax._src.random import threefry2x32

    rule = (
        threefry2x32._threefry2x32_lowering_rule
        if unrolled
        else threefry2x32._threefry2x32_cpu_lowering_rule
    )
    mlir.register_lowering(threefry2x32.threefry2x32_p, rule, platform="cpu")


def use_compile_cache(enabled: bool = True) -> str | None:
    """Keep compiled programs in JAX's persistent compilation cache, so that a repeated run
    (same trainer, flags that shape the program, devices and JAX version) loads its programs
    from disk instead of compiling them again. The cache is `$JAX_COMPILATION_CACHE_DIR` when
    set, else `$XDG_CACHE_HOME/purejaxrl/jax` (`~/.cache/purejaxrl/jax`). Programs that
    compile in under a tenth of a second are not worth a file. A directory that cannot be
    created turns the cache off with a one-line notice. Returns the directory, or None when
    the cache is off (then nothing is read or written)."""
    directory = jax.config.jax_compilation_cache_dir
    if not directory:
        cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        directory = os.path.join(cache_home, "purejaxrl", "jax")
    if enabled:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as error:
            print(
                f"compile cache off: cannot create {directory} ({error.strerror})", file=sys.stderr
            )
            enabled = False
    if not enabled:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)
    return directory


def xla_flags_with(flag: str, value, flags: str | None = None) -> str:
    """`flags` (default: this process's XLA_FLAGS) with `flag=value` in place of any value the
    flag had, every other flag kept."""
    if flags is None:
        flags = os.environ.get("XLA_FLAGS", "")
    kept = re.sub(rf"{flag}=\S+", "", flags).split()
    return " ".join([*kept, f"{flag}={value}"])


def xla_flags_with_cpu_devices(num_cpu_devices: int) -> str:
    """This process's XLA_FLAGS with the CPU device count set to `num_cpu_devices`: the
    environment a process needs to start with that many CPU devices."""
    return xla_flags_with(_DEVICE_COUNT_FLAG, num_cpu_devices)


def split_cpu_host(num_cpu_devices: int, processes: dict | None = None) -> None:
    """Give the CPU backend `num_cpu_devices` devices (0: leave it alone, -1: one per core) and,
    with `processes` (jax.distributed.initialize's arguments, None values for "ask the cluster
    or JAX's environment variables"), join a multi-process run.

    JAX fixes the CPU device count when its backend starts, and jax.distributed must start
    before the backend does, yet importing gymnax or pgx already starts it. So when either is
    needed, the process restarts itself once (same interpreter, same arguments) with the XLA
    flag in the environment and, for several processes, through a small launcher that joins
    the process group before the script runs. On a GPU or TPU host the CPU split does nothing.
    """
    if num_cpu_devices < -1:
        raise ConfigError(
            f"--cpu-devices must be >= -1 (0: JAX's default, -1: one per core), got "
            f"{num_cpu_devices}"
        )
    if num_cpu_devices == -1:
        num_cpu_devices = available_cores()
    split = num_cpu_devices > 0 and jax.default_backend() == "cpu"
    resplit = split and jax.local_device_count() != num_cpu_devices
    join = processes is not None and not jax.distributed.is_initialized()
    if not (resplit or join):
        return
    if resplit and not _started_as_a_script():
        raise ConfigError(
            f"--cpu-devices {num_cpu_devices}: splitting the CPU needs a fresh process, and this "
            "one was not started as a script (a notebook, python -m or an import); start Python "
            f"with XLA_FLAGS={_DEVICE_COUNT_FLAG}={num_cpu_devices} instead, or set "
            "--cpu-devices 0"
        )
    asked = f"cpu_devices={num_cpu_devices if split else 0} join={join}"
    if os.environ.get(_RESTARTED) == asked:
        raise ConfigError(
            f"--cpu-devices {num_cpu_devices}: JAX still shows {jax.local_device_count()} CPU "
            "device(s) after restarting with XLA_FLAGS set; is XLA_FLAGS overridden elsewhere?"
            if resplit
            else "--distributed: the process group did not start after restarting"
        )
    command = [sys.executable, *sys.orig_argv[1:]]
    if join:
        script = sys.orig_argv[1] if len(sys.orig_argv) > 1 else "-"
        if script.startswith("-") or not os.path.isfile(script):
            raise ConfigError(
                "--distributed runs start from a trainer script, e.g. "
                "python purejaxrl_ppo.py --distributed ..."
            )
        command = [sys.executable, "-c", _LAUNCHER, *sys.orig_argv[1:]]
    # Every check has passed: only now the environment the restarted process reads, so that a
    # refused call (in a notebook, say) leaves this process as it was.
    if split:
        os.environ["XLA_FLAGS"] = xla_flags_with_cpu_devices(num_cpu_devices)
    os.environ[_RESTARTED] = asked
    if join:
        os.environ[_PROCESSES] = json.dumps(processes)
    sys.stdout.flush()
    sys.stderr.flush()
    interrupts.keep_pending_across_exec()
    os.execv(sys.executable, command)


def _started_as_a_script() -> bool:
    """Whether restarting this process with the same arguments reruns what the user started:
    `python script.py ...` or `python -c CODE ...`, not `python -m` (e.g. a Jupyter kernel)
    or an interactive interpreter."""
    args = sys.orig_argv[1:]
    interactive = hasattr(sys, "ps1") or sys.flags.interactive
    return not interactive and bool(args) and (args[0] == "-c" or os.path.isfile(args[0]))


# What split_cpu_host restarted this process for, so that it never restarts in a loop.
_RESTARTED = "PUREJAXRL_RESTARTED"
# jax.distributed.initialize's arguments, as JSON, for the launcher.
_PROCESSES = "PUREJAXRL_PROCESSES"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCHER = (
    f"import sys; sys.path.insert(0, {_REPO!r}); "
    "from utils.interrupts import exit_at_once_on_stop_signals; exit_at_once_on_stop_signals(); "
    "from utils.devices import join_processes_and_run; join_processes_and_run()"
)


def join_processes_and_run() -> None:
    """The launcher behind `python -c _LAUNCHER script.py args`: start jax.distributed, then
    run the script as __main__ with its own arguments."""
    arguments = {k: v for k, v in json.loads(os.environ[_PROCESSES]).items() if v is not None}
    jax.distributed.initialize(**arguments)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


def process_group(config) -> dict | None:
    """jax.distributed.initialize's arguments for a multi-process run, None for one process.
    Unset flags fall back to JAX_NUM_PROCESSES / JAX_PROCESS_ID, then to the cluster (SLURM,
    Open MPI, Kubernetes, Cloud TPU), which JAX detects; JAX reads JAX_COORDINATOR_ADDRESS
    itself."""
    given = (config.coordinator_address, config.num_processes, config.process_id)
    if not config.distributed and all(value is None for value in given):
        return None
    num_processes = config.num_processes or _env_int("JAX_NUM_PROCESSES")
    process_id = config.process_id if config.process_id is not None else _env_int("JAX_PROCESS_ID")
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and not 0 <= process_id < (num_processes or process_id + 1):
        raise ConfigError(f"--process-id {process_id} is not in [0, {num_processes})")
    return {
        "coordinator_address": config.coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"${name} must be an integer, got {value!r}") from None


def resolve_num_devices(requested: int) -> int:
    """`requested` local devices, or all of them for 0; a clear error if there are too few.
    A multi-process run uses every device of every process: the result counts them all."""
    available = jax.local_device_count()
    if requested < 0:
        raise ConfigError(f"--num-devices must be >= 0 (0 means all), got {requested}")
    if jax.process_count() > 1:
        if requested not in (0, jax.device_count()):
            raise ConfigError(
                f"--num-devices {requested}: a run of {jax.process_count()} processes uses all "
                f"{jax.device_count()} devices; leave --num-devices at 0"
            )
        return jax.device_count()
    if requested > available:
        raise ConfigError(
            f"--num-devices {requested} asks for more devices than the {available} available "
            f"({jax.default_backend()}); on a CPU, --cpu-devices N splits the host into N devices"
        )
    return requested or available
