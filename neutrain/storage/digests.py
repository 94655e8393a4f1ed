"""sha256 of checkpoint files on threads: while a file is written, and when it is read back for a check.

Why: a manifest holds each file's sha256 and each safetensors tensor's, so every byte is hashed twice. An
offloaded Llama-3-70B's 89 GiB checkpoint was written, then read back and hashed on the writing thread and
one more (the manifest), and read and hashed the same way at every resume and export: minutes a stage.

* **While writing** (:class:`Digests`): the bytes a writer hands the file are hashed beside the write, the
  file's hash on one thread (it must see the bytes in order) and the tensors' on a few more (each tensor's
  bytes on one of them, so its updates stay in order; hashlib lets go of the GIL). The writer then
  :func:`remember`\\ s the digests under the file's identity (device, inode, size, modification time), and
  :func:`neutrain.storage.manifest.write_manifest` takes them instead of reading the file again. A file
  changed since (another size or time) is read as before.
* **When checking** (:func:`file_digests`): the same threads hash what one reader reads in large sequential
  blocks, so reading and both hashes overlap. A check never takes remembered digests: it reads the disk.
  Where the manifest holds a safetensors file's header digest, the check takes the tensors' digests only
  (``whole=False``): the file's sha256, one serial pass, bounded it at about 1 GB/s.

The digests are the same numbers either way; only the threads that compute them differ.

Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "t.bin")
    >>> with open(path, "wb") as fh, Digests() as digests:
    ...     for data, name in ((b"head", None), (b"abc", "a")):
    ...         _ = fh.write(data); digests.add(data, name)
    >>> whole, tensors = digests.result()
    >>> file_digests(path, [(4, 7, "a")]) == (whole, tensors)
    True
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

BLOCK = 1 << 24
"""Bytes a read takes: large sequential reads, each hashed as it arrives."""
IN_FLIGHT = 1 << 30
"""Bytes handed to the hashing threads and not yet hashed: past it the writer (or reader) waits, so a host
copy of a device tensor is never held long after its write."""
_REMEMBERED = 64  # files whose digests are kept for the manifest (a checkpoint has a handful)
_remembered: dict[tuple[int, int, int, int], tuple[str, dict[str, str]]] = {}


def _workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class Digests:
    """sha256 of a file's bytes, and of each named tensor's, computed on threads as the bytes are added in file
    order. Use as a context manager (the threads end with it); :meth:`result` waits for the hashes."""

    def __init__(self, whole: bool = True) -> None:
        self._whole = hashlib.sha256() if whole else None  # None: the tensors' digests only (no serial pass)
        self._ordered = ThreadPoolExecutor(1, thread_name_prefix="sha256-file")
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix="sha256-tensor") for _ in range(_workers())]
        self._tensors: dict[str, hashlib._Hash] = {}
        self._lane_of: dict[str, ThreadPoolExecutor] = {}
        self._pending: deque[tuple[int, list[Future]]] = deque()
        self._held = 0

    def add(self, data, tensor: str | None = None) -> None:
        """Hash ``data`` (bytes-like, the next bytes of the file), also as part of ``tensor`` when named.

        ``data`` must not change until it is hashed: the writer's own tensor memory, or a copy it drops."""
        view = memoryview(data).cast("B")
        if not view.nbytes:
            if tensor is not None:
                self._tensors.setdefault(tensor, hashlib.sha256())
            return
        futures = [self._ordered.submit(self._whole.update, view)] if self._whole is not None else []
        if tensor is not None:
            if tensor not in self._tensors:
                self._tensors[tensor] = hashlib.sha256()
                self._lane_of[tensor] = self._lanes[len(self._lane_of) % len(self._lanes)]
            futures.append(self._lane_of[tensor].submit(self._tensors[tensor].update, view))
        self._pending.append((view.nbytes, futures))
        self._held += view.nbytes
        while self._held > IN_FLIGHT:
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        nbytes, futures = self._pending.popleft()
        for future in futures:
            future.result()
        self._held -= nbytes

    def result(self) -> tuple[str | None, dict[str, str]]:
        """``(file sha256, {tensor: sha256})``, once every byte added is hashed (the file's None without ``whole``)."""
        while self._pending:
            self._settle_oldest()
        whole = self._whole.hexdigest() if self._whole is not None else None
        return whole, {name: h.hexdigest() for name, h in self._tensors.items()}

    def __enter__(self) -> "Digests":
        return self

    def __exit__(self, *exc) -> None:
        for pool in (self._ordered, *self._lanes):
            pool.shutdown(wait=True)


def file_digests(path: str | os.PathLike, spans: list[tuple[int, int, str]],
                 whole: bool = True) -> tuple[str | None, dict[str, str]]:
    """``(file sha256, {tensor: sha256})`` of the file at ``path``, read once in :data:`BLOCK` reads.

    ``spans``: ``(begin, stop, name)`` byte ranges of the tensors, ascending and apart. ``whole=False``: the
    tensors' digests only (the file's is None, and bytes outside the spans are skipped, not read). The file's
    sha256 is one serial pass (about 1 GB/s), the tensors' spread over threads: an 89 GiB checkpoint's check
    took ~100 s on the file's alone.

    Raises:
        EOFError: the file ends before a span does (it shrank while being read).
    """
    size = os.stat(path).st_size
    with open(path, "rb", buffering=0) as fh, Digests(whole) as digests:
        pos = 0

        def read_to(stop: int, tensor: str | None = None) -> None:
            nonlocal pos
            if tensor is None and not whole:  # bytes no digest takes
                stop = min(stop, size)
                fh.seek(stop)
                pos = stop
                return
            while pos < stop:
                chunk = fh.read(min(BLOCK, stop - pos))
                if not chunk:
                    raise EOFError(f"'{path}' ends at byte {pos}, before byte {stop}")
                digests.add(chunk, tensor)
                pos += len(chunk)

        for begin, stop, name in spans:
            read_to(begin)
            if begin == stop:
                digests.add(b"", name)
            read_to(stop, name)
        read_to(size)
        return digests.result()


def _identity(path: str | os.PathLike) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def remember(path: str | os.PathLike, whole: str | None, tensors: dict[str, str]) -> None:
    """Keep the digests of the file just written at ``path`` (complete, synced) for its manifest."""
    while len(_remembered) >= _REMEMBERED:
        _remembered.pop(next(iter(_remembered)))
    _remembered[_identity(path)] = (whole, dict(tensors))


def remembered(path: str | os.PathLike) -> tuple[str | None, dict[str, str]] | None:
    """The digests :func:`remember` kept for ``path``, if the file is still the one written (same device,
    inode, size and modification time: a rename keeps them, a rewrite does not); else None."""
    try:
        return _remembered.get(_identity(path))
    except OSError:
        return None


def forget_all() -> None:
    """Drop every remembered digest (a manifest then reads every file)."""
    _remembered.clear()
