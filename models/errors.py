"""Exceptions shared by the model layer; the CLI and the service map them to exit codes / HTTP statuses."""


from pathlib import Path


class LatentLMError(Exception):
    """Base class. `param` names the offending field or file when there is one; `code` is the service's error code
    when it is not its class's default (e.g. `unsupported_parameter` for an UnsupportedOperation)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ArtifactError(LatentLMError):
    """A model directory is missing, corrupt, or not a valid artifact (names the file and the problem)."""


class ModelNotFound(LatentLMError):
    """No model of that name in the store."""


class InputError(LatentLMError):
    """Malformed input: empty sequence, token id out of range, unknown word without `<unk>`, ..."""


class UnsupportedOperation(LatentLMError):
    """The family does not support the requested operation (e.g. Viterbi in rank space beyond its limit)."""


class LimitExceeded(LatentLMError):
    """A request is too large (tokens, states x states matrix, ...)."""


def read_text_file(path: Path, *, param: str, prefix: str = "") -> str:
    """The UTF-8 text of a user-supplied file, or an InputError naming `param`: "<prefix><path>: no such
    file" / "... not UTF-8 text"."""
    if not path.is_file():
        raise InputError(f"{prefix}{path}: no such file", param=param)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{prefix}{path}: not UTF-8 text ({e})", param=param) from None
