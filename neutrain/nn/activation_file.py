"""Checkpointed layers' saved inputs spilled to a file: the disk tier below pinned host memory.

Why: a host that cannot pin every checkpointed layer's input beside the streamed weights (the 70B at 16K
tokens: 20 GiB of inputs on top of 88 GiB of weights) can still train if some of them wait on a disk
between forward and backward. :mod:`neutrain.memory.tiers` decides how many; :class:`FileStash` moves them.

Each tensor is written through one small pinned staging buffer (a copy over PCIe needs pinned memory;
the file does not) and read back through it in backward, chunk by chunk, on the caller's stream: the
bytes that come back are the bytes that went out. Space in the file is handed out from its start and
reused once every tensor written to it has been read back or dropped (an exception in the middle of a
step drops the graph, and with it the records).

The file is unlinked as soon as it is opened: it has no name from then on, so whichever way the process
ends (a finished run, an exception, a kill) the kernel frees its space, and no stale file is left under
the run's folder. It is opened at its first write; :meth:`ActivationFile.close` frees it at the end of training.

On a CPU the saved tensors are host tensors already and :class:`FileStash` keeps them as they are, unless
``spill_host_tensors`` (the tests' way to run the file's write and read on a CPU).

Example:
    >>> import tempfile
    >>> import torch
    >>> with tempfile.TemporaryDirectory() as folder, ActivationFile(folder, staging_bytes=64) as spill:
    ...     x = torch.randn(10, 7)
    ...     record = spill.write(x)
    ...     torch.equal(spill.read(record), x), spill.end, os.listdir(folder)
    (True, 4096, [])
"""

from __future__ import annotations

import os

import torch

STAGING_BYTES = 64 << 20
"""Bytes of the pinned staging buffer (the planner's ``ACTIVATION_STAGING_BYTES``: the same figure)."""
ALIGN = 4096  # each tensor starts on a page: whole-page reads and writes


class Spilled:
    """One tensor in the file: where its bytes are and what it was. Dropping it frees its space."""

    __slots__ = ("owner", "offset", "nbytes", "shape", "dtype", "device", "opened", "__weakref__")

    def __init__(self, owner: ActivationFile, offset: int, nbytes: int, tensor: torch.Tensor):
        self.owner, self.offset, self.nbytes, self.opened = owner, offset, nbytes, owner._opened
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device

    def __del__(self):
        owner = getattr(self, "owner", None)
        if owner is not None:
            owner._release(self.opened)


class ActivationFile:
    """An unnamed file under ``folder`` that tensors are written to and read back from, bit for bit."""

    def __init__(self, folder: str | os.PathLike, staging_bytes: int = STAGING_BYTES):
        self.folder = str(folder)
        self._staging_bytes = staging_bytes
        self._staging: torch.Tensor | None = None
        self._fd: int | None = None
        self._opened = 0  # times opened: a record of an earlier opening has lost its bytes
        self.end = 0  # the next free byte
        self.live = 0  # records written and not yet dropped
        self.written_bytes = 0
        self.read_bytes = 0

    def _open(self) -> None:
        """Open the file at its first write (again after :meth:`close`: a later run of the same trainer)."""
        os.makedirs(self.folder, exist_ok=True)
        path = os.path.join(self.folder, f"activations-{os.getpid()}")
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.unlink(path)  # nameless from here on: the kernel frees it however the process ends
        if self._staging is None:
            self._staging = torch.empty(self._staging_bytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self._opened += 1
        self.end = 0

    def write(self, tensor: torch.Tensor) -> Spilled:
        """Write ``tensor``'s bytes to the file; the record reads them back (:meth:`read`)."""
        if self._fd is None:
            self._open()
        data = _bytes_of(tensor.detach().contiguous())
        offset, n = self.end, data.numel()
        self.end += -(-n // ALIGN) * ALIGN
        view = self._staging.numpy()
        for start in range(0, n, self._staging.numel()):
            part = data[start:start + self._staging.numel()]
            m = part.numel()
            self._staging[:m].copy_(part)  # device to the pinned buffer, waited for: it is reused next
            done = 0
            while done < m:
                done += os.pwrite(self._fd, view[done:m], offset + start + done)
        self.live += 1
        self.written_bytes += n
        return Spilled(self, offset, n, tensor)

    def read(self, record: Spilled) -> torch.Tensor:
        """The tensor ``record`` was written from, on its device."""
        if self._fd is None or record.opened != self._opened:
            raise ValueError("the activation file was closed after this tensor was written: its bytes are gone")
        out = torch.empty(record.shape, dtype=record.dtype, device=record.device)
        data = _bytes_of(out)
        view = self._staging.numpy()
        for start in range(0, record.nbytes, self._staging.numel()):
            m = min(self._staging.numel(), record.nbytes - start)
            done = 0
            while done < m:
                got = os.preadv(self._fd, [view[done:m]], record.offset + start + done)
                if got <= 0:
                    raise OSError(f"the activation file under {self.folder} ended early")
                done += got
            data[start:start + m].copy_(self._staging[:m])  # waited for before the buffer is reused
        self.read_bytes += record.nbytes
        return out

    def _release(self, opened: int) -> None:
        if opened != self._opened:
            return  # written before the file was closed: its space went with it
        self.live -= 1
        if self.live == 0:
            self.end = 0  # every tensor of the step is back: the next step writes from the start

    def close(self) -> None:
        """Free the file's space (it has no name to remove)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.live, self.end = 0, 0

    @property
    def closed(self) -> bool:
        return self._fd is None

    def __enter__(self) -> ActivationFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view."""
    return tensor.reshape(-1).view(torch.uint8)


class FileStash(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of a device go to ``spill`` (an :class:`ActivationFile`) and come back when backward
    needs them. Host tensors are kept as they are, unless ``spill_host_tensors``."""

    def __init__(self, spill: ActivationFile, spill_host_tensors: bool = False):
        self.packed = 0
        self.packed_bytes = 0

        def pack(tensor: torch.Tensor):
            if tensor.device.type == "cpu" and not spill_host_tensors:
                return tensor
            record = spill.write(tensor)
            self.packed += 1
            self.packed_bytes += record.nbytes
            return record

        def unpack(packed):
            return spill.read(packed) if isinstance(packed, Spilled) else packed

        super().__init__(pack, unpack)
