"""A small file system a test mounts for itself: a tmpfs of a given size that it can fill, make
read-only and take away, so disk faults hit the real code paths instead of a patched ``open``.

Mounting needs root (the CI runners and the dev container run the tests as root). Without it the
fixture fails with a clear line rather than skipping, so a missing disk-fault run never looks green.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

BALLAST_NAME = "ballast"
_FILL_CHUNK_BYTES = 256 * 1024


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=False)


def _is_mount_point(path: Path) -> bool:
    return os.path.ismount(path)


class SmallFs:
    """One tmpfs at ``root``; ``work_root`` is a directory on it (the ballast sits beside it)."""

    def __init__(self, root: Path, size_bytes: int):
        self.root = root
        self.size_bytes = size_bytes
        self.work_root = root / "work"
        self._ballast = root / BALLAST_NAME
        self._read_only_layers = 0

    # --- life
    def mount(self) -> None:
        if os.geteuid() != 0:
            pytest.fail("the disk-fault tests mount a tmpfs and need root (they run as root in CI); "
                        "run them as root, e.g. in the dev container", pytrace=False)
        self.root.mkdir(parents=True, exist_ok=True)
        done = _run("mount", "-t", "tmpfs", "-o", f"size={self.size_bytes},mode=0755", "tmpfs", str(self.root))
        if done.returncode != 0:
            pytest.fail(f"could not mount a tmpfs at {self.root}: {done.stderr.strip()}", pytrace=False)
        self.work_root.mkdir()

    def unmount_all(self) -> None:
        """Take every layer off ``root`` (lazily when something still holds it)."""
        for _ in range(8):
            if not _is_mount_point(self.root):
                return
            if _run("umount", str(self.root)).returncode != 0:
                _run("umount", "-l", str(self.root))
        assert not _is_mount_point(self.root), f"{self.root} is still mounted"

    # --- faults
    def free_bytes(self) -> int:
        info = os.statvfs(self.root)
        return info.f_bavail * info.f_frsize

    def fill(self, leave_bytes: int = 0) -> None:
        """Write a ballast file until at most ``leave_bytes`` are free."""
        with open(self._ballast, "ab") as ballast:
            while (room := self.free_bytes() - leave_bytes) > 0:
                try:
                    ballast.write(b"\0" * min(room, _FILL_CHUNK_BYTES))
                    ballast.flush()
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    break
        assert self.free_bytes() <= leave_bytes

    def drain(self) -> None:
        """Free the space the ballast took."""
        self._ballast.unlink(missing_ok=True)

    def read_only(self) -> None:
        """From now on every new open for writing, create, rename and unlink fails with EROFS.

        ``mount -o remount,ro`` refuses (EBUSY) while any file is open for writing, which a running
        job always has (its step log). A read-only bind mount stacked on the same path takes effect
        at once for every new path lookup, as a file system remounted read-only by the kernel would;
        descriptors opened before keep writing to the layer below.
        """
        for argv in (("mount", "--bind", str(self.root), str(self.root)),
                     ("mount", "-o", "remount,bind,ro", str(self.root))):
            done = _run(*argv)
            assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr.strip()}"
        self._read_only_layers += 1

    def writable_again(self) -> None:
        assert self._read_only_layers, "not made read-only"
        done = _run("umount", str(self.root))
        assert done.returncode == 0, done.stderr
        self._read_only_layers -= 1

    def vanish(self) -> None:
        """Unmount the file system (lazily: the job still holds files on it); ``root`` is left empty."""
        done = _run("umount", "-l", str(self.root))
        assert done.returncode == 0, done.stderr
        assert not _is_mount_point(self.root)


@pytest.fixture
def small_fs(tmp_path) -> Iterator[SmallFs]:
    """A 4 MiB tmpfs at ``tmp_path/fs``, unmounted (lazily if need be) whatever the test did."""
    fs = SmallFs(tmp_path / "fs", 4 * 1024 * 1024)
    fs.mount()
    try:
        yield fs
    finally:
        fs.unmount_all()
