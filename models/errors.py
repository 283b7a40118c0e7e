"""Exceptions shared by the model layer; the CLI and the service map them to exit codes / HTTP statuses."""


class LatentLMError(Exception):
    """Base class. `param` names the offending field or file when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


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
