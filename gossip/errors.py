"""The project's own error types: `MurmurError`, their common base, and the errors the gossip layer raises
or, like `TaskError` (the validation pipeline's task resolver raises it), catches.

Every decoder, handler and CLI command raises (or catches and reports) a `MurmurError`, so a caller can
tell bad input from a bug: anything else escaping a decoder is a bug. The other layers' own errors live
beside them (`sync/errors.py`: patches; `node/store.py`: the state database).
"""

from __future__ import annotations


class MurmurError(Exception):
    """Base class: a clear, one-line message about bad input or state."""


class ConfigError(MurmurError):
    """A config file or override is malformed; the message names the file and key."""


class IdentityError(MurmurError):
    """A key file is missing, corrupt or has unsafe permissions."""


class DecodeError(MurmurError):
    """Bytes from outside do not decode into a valid message of the expected kind."""


class SignatureError(DecodeError):
    """A signature does not verify for the claimed key and signing domain."""


class TaskError(MurmurError):
    """A task reference or task set cannot be resolved, or names unknown parts."""
