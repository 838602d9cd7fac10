"""The one way a download reaches its destination: through ``<dest>.part``, renamed only when whole."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeline.errors import DownloadError
from pipeline.files import fsync_dir


@contextmanager
def part_file(dest: Path, *, sync_dir: bool = True) -> Iterator[Callable[[bytes], None]]:
    """Yield a writer into ``dest.part``; rename it onto ``dest`` on success, remove it on any failure.

    ``sync_dir=False`` leaves the directory's sync to the caller (once for many files): the data is
    synced before the rename either way, so a crash can lose the new name, never leave a partial file.
    """
    part = dest.with_name(dest.name + ".part")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted at the .part name must not redirect the write.
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise DownloadError(f"cannot write {part.name}: {_os_reason(exc)}") from None

    def write(data: bytes) -> None:
        try:
            file.write(data)
        except OSError as exc:
            raise DownloadError(f"writing {part.name} failed: {_os_reason(exc)}") from None

    try:
        with os.fdopen(fd, "wb") as file:
            yield write
            file.flush()
            os.fsync(file.fileno())
        os.replace(part, dest)
        if sync_dir:
            # The rename is durable only once the directory entry is on disk.
            fsync_dir(dest.parent, strict=True)
    except OSError as exc:
        part.unlink(missing_ok=True)
        raise DownloadError(f"finishing {dest.name} failed: {_os_reason(exc)}") from None
    except BaseException:
        part.unlink(missing_ok=True)
        raise


def _os_reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__
