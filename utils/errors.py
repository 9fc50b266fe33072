"""The one exception type that user-facing validation raises."""


class ConfigError(ValueError):
    """A bad flag or input, reported as one sentence with exit code 2 before anything compiles."""
