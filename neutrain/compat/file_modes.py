"""File modes of what neutrain writes (every file as ``open()`` makes it, ``0o666`` less the umask), and
syncing a directory's entries where the platform can (:func:`fsync_dir`).

Why: safetensors 0.8 creates its files with mode ``0o600`` (owner only), while Python's
``open()``, ``torch.save`` and ``json`` writers give ``0o644`` under the usual umask. A
checkpoint or export then had a ``model.safetensors`` that another user, or a serving
container running as another uid, could not read ("Permission denied"), next to configs they
could. :func:`honour_umask` gives the files of a freshly written directory the mode the
process's umask asks for; it is called on each checkpoint and export before its manifest is
written (:func:`neutrain.storage.manifest.write_manifest`).

Example:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> (d / "model.safetensors").touch(mode=0o600)
    >>> honour_umask(d)
    >>> oct((d / "model.safetensors").stat().st_mode & 0o777) == oct(0o666 & ~current_umask())
    True
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read without changing it where ``/proc`` tells it (Linux), else set and restored."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(directory: str | os.PathLike) -> None:
    """Give every regular file under ``directory`` the mode ``0o666 & ~umask`` (links are not followed)."""
    mode = 0o666 & ~current_umask()
    for root, _dirs, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            st = path.lstat()
            if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) != mode:
                os.chmod(path, mode)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (a rename into it) to disk; a no-op where directories cannot be opened
    (Windows), which is the platform difference this adapter hides.

    Example:
        >>> import tempfile
        >>> fsync_dir(tempfile.mkdtemp())
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
