"""Exceptions that reach users: each says what was wrong and how to fix it."""


class DsparkError(Exception):
    """Base class for errors dspark-jax raises on purpose."""


class CheckpointError(DsparkError):
    """A model folder is missing a file, holds the wrong architecture or corrupt weights."""


class InvalidRequestError(DsparkError, ValueError):
    """A request cannot be served as asked (empty prompt, bad ids, bad sampling values, too long)."""


class KVPoolFullError(DsparkError):
    """The paged KV pool has too few free pages for an allocation; nothing was changed."""
