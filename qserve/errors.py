"""Errors a user can cause. Each carries a one-line message that names the bad value."""


class QServeError(ValueError):
    """Base class: bad input from the user (flag, request, file). Subclasses ValueError so the
    Python API raises the ValueError callers expect."""


class ModelLoadError(QServeError):
    """A model could not be found, read or understood (names the file and the problem)."""


class ConfigError(QServeError):
    """An engine, cache or scheduler setting is out of range or inconsistent."""


class QueueFullError(QServeError):
    """The engine's waiting queue is at its bound (SchedulerConfig.max_waiting); retry later."""
