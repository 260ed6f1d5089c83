"""Error types raised by the engine; the HTTP layer maps each to a status code in one place."""

# The most characters of one value a client sent that an error message quotes: enough to find the
# mistake in, never a client's whole field (which may be megabytes, or made to fill a log).
QUOTED_CHARS = 100


def quoted(value: object) -> str:
    """``value``, something a client sent, in single quotes for an error message: its first
    QUOTED_CHARS characters, with characters that are not printable (newlines among them, which
    could forge a log line) escaped."""
    text = str(value)
    shown = "".join(char if char.isprintable() else repr(char)[1:-1] for char in text[:QUOTED_CHARS])
    if len(text) <= QUOTED_CHARS:
        return f"'{shown}'"
    return f"'{shown}...' ({len(text)} characters)"


class EngineError(Exception):
    """Base class for every error the engine raises on purpose."""


class AudioDecodeError(EngineError, ValueError):
    """The bytes given as audio could not be decoded (empty, not audio, corrupt, bad samples)."""


class ModelNotFoundError(EngineError, LookupError):
    """A model name resolved to nothing: not bundled, not a folder, not in the local HF cache."""


class WeightsFormatError(EngineError, ValueError):
    """A model file exists but is corrupt or of an unknown layout; the message names the file."""


class RequestRejectedError(EngineError, ValueError):
    """A request's options are invalid for this model (e.g. a language it does not know)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param  # the request field at fault, for the HTTP error's `param`


class CacheFullError(EngineError, RuntimeError):
    """The KV block pool cannot hold a request even when empty: the memory budget is too small."""


class WindowFailedError(EngineError, RuntimeError):
    """A window failed for a reason of the server's that trying again would not cure (the model's
    activations overflowed on it): the request fails with what happened, in words."""


class RetriableError(EngineError, RuntimeError):
    """A request failed for a reason that trying again (re-encoding, another replica) may cure,
    such as a lost cross-attention K/V transfer. The HTTP layer retries or answers 503."""


class NoRoomError(EngineError, RuntimeError):
    """A bounded resource stayed full for the whole of a request's wait; ``what`` names it in words
    that follow "room in" (the ingress answers 503 with them), ``waited_s`` is the wait."""

    def __init__(self, what: str, waited_s: float):
        super().__init__(f"waited {waited_s:g} s for room in {what}")
        self.what = what
        self.waited_s = waited_s

    def __reduce__(self):
        return type(self), (self.what, self.waited_s)


class AudioTooLongError(EngineError, ValueError):
    """The audio is longer than the caller accepts: its header says so (``claimed``), or decoding
    produced more samples than allowed and was stopped there."""

    def __init__(self, duration_s: float, max_duration_s: float, claimed: bool):
        if claimed:
            message = f"the file's header says it holds {duration_s:.0f} s of audio"
        else:
            message = f"the audio runs past {max_duration_s:.0f} s (decoding stopped there)"
        super().__init__(f"{message}; this server accepts at most {max_duration_s:.0f} s")
        self.duration_s = duration_s
        self.max_duration_s = max_duration_s
        self.claimed = claimed

    def __reduce__(self):
        # Pickled with its own arguments (it crosses from a decoding process), not its message.
        return type(self), (self.duration_s, self.max_duration_s, self.claimed)
