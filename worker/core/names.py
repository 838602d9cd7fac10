"""The rules for a name that becomes a file path component or an S3 key part.

Its own module, free of heavy imports, so the reference trainer's subprocesses can share it too.
"""

import re
from typing import TypeGuard

# 1-128 letters, digits, '.', '_' or '-', starting alphanumeric: never empty, '.', '..' or a '/'.
SAFE_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"  # full match only (ASCII classes)


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def is_sha256_hex(value: object) -> TypeGuard[str]:
    """A SHA-256 as the worker writes it, and as it names S3 keys: 64 lowercase hex digits, nothing else.
    The one check of a digest read back from a manifest, a mirror listing, a record or a key."""
    return isinstance(value, str) and _SHA256_HEX.fullmatch(value) is not None
