"""The exceptions that reach the user as one sentence and an exit code, not a traceback."""


class ConfigError(ValueError):
    """A bad flag or input, reported as one sentence with exit code 2 before anything compiles."""


class OutputError(RuntimeError):
    """A file of a run that could not be written (a full disk, a read-only directory): one
    sentence with the file, the error and how to resume, exit code 1. The run's last
    checkpoint is intact."""
