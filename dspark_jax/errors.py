"""Exceptions that reach users: each says what was wrong and how to fix it."""


class DsparkError(Exception):
    """Base class for errors dspark-jax raises on purpose."""


class CheckpointError(DsparkError):
    """A model folder is missing a file, holds the wrong architecture or corrupt weights."""


class InvalidRequestError(DsparkError, ValueError):
    """A request cannot be served as asked (empty prompt, bad ids, bad sampling values, too long)."""


class KVPoolFullError(DsparkError):
    """The paged KV pool has too few free pages for an allocation; nothing was changed."""


def read_json(path, what: str, error: type[DsparkError] = CheckpointError):
    """The JSON value in the file at `path`; a missing or unparsable file raises `error` naming `what`."""
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not a valid {what}, not valid JSON ({e})") from None
    except OSError as e:
        raise error(f"{path}: unreadable {what} ({e})") from None
