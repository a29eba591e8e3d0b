"""The project's own error types.

Every decoder, handler and CLI command raises (or catches and reports) one of
these, so a caller can tell bad input from a bug: anything else escaping a
decoder is a bug.
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


class StoreError(MurmurError):
    """The state database cannot be opened or migrated."""


class TaskError(MurmurError):
    """A task reference or task set cannot be resolved, or names unknown parts."""


class PatchError(MurmurError):
    """A patch cannot be applied: wrong base, corrupt or missing chunk, bad hash."""


class NonFiniteWeights(PatchError):
    """A state, patch or anchor would put a non-finite value (NaN, +-inf) into a weight. Raised by a
    follower for a patch whose signed, hash-checked content does so (the publisher's provable fault),
    and by a publisher that refuses to sign such a version."""
