"""The one rule for a name that becomes a file path component or an S3 key part.

Its own module, free of heavy imports, so the reference trainer's subprocesses can share it too.
"""

# 1-128 letters, digits, '.', '_' or '-', starting alphanumeric: never empty, '.', '..' or a '/'.
SAFE_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"  # full match only (ASCII classes)
