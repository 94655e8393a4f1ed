"""Weight offload: decoder layers' compressed weights live in (pinned) host memory, streamed in per layer.

A compressed weight's payload is four tensors of its ``CompressedTensor``: the
entropy-coded exponent ``stream``, the raw sign/mantissa ``tails``, the per-lane
word counts ``lane_words`` and the tile table ``tile_base`` (about 1.33 bytes per
bf16 weight). :class:`WeightOffload` keeps that payload of every decoder layer's
weights in host memory (the source of truth) and, on the device, only a ring of
``slots`` layer-sized staging buffers:

* **Fetch.** A layer's payload is copied into a free slot on a host-to-device copy
  stream and the weights' tensors point into the slot. Whenever a layer's weight is
  decoded (forward, a checkpoint's recompute, backward, the fused update) the store
  makes the layer current, makes the compute stream wait for the copy's event, and
  starts copying the next ``ahead`` layers (the following ones in forward, the
  preceding ones in backward: a checkpoint recompute runs inside backward). A slot
  allocated anew is filled only after the compute stream's queued work: the allocator
  may have given it memory that work still uses.
* **Write-back.** After the fused update re-encodes a weight (in the slot), its new
  payload goes back to host memory on a device-to-host copy stream, after an event
  of the compute stream; the layer's ``flushed`` event orders any later copy into
  that slot, or out of those host buffers, after it.
* **Sizes change.** A re-encode may grow the stream (a fresh device tensor,
  :mod:`neutrain.compress.stream`): the write-back then allocates a larger host
  buffer first, and the next fetch lays the slot out from the host sizes (growing
  the slot, after a synchronisation, if a layer no longer fits). No byte is lost.
* **Eviction.** Loading a layer when no slot is free evicts the least recently
  wanted resident layer other than the current one; the copy stream first waits for
  the compute stream's last use of it (an event recorded when the compute moved on).

Embedding and lm_head stay on the device. With device and host both CPU the same code
runs with plain synchronous copies, which is how the CPU tests check it bit for bit.

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, AutoModelForCausalLM
    >>> from neutrain.nn import compress_model, causal_lm_loss
    >>> from neutrain.optim import LOMO
    >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    >>> model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    >>> _ = compress_model(model, progress=False, codec_options={"steps": 16})
    >>> from neutrain.nn.weight_offload_model import offload_weights
    >>> store = offload_weights(model, ahead=1)
    >>> opt = LOMO(model.parameters(), lr=1e-3, stochastic_rounding=False).bind(model)
    >>> ids = torch.randint(0, 64, (1, 8))
    >>> opt.backward(causal_lm_loss(model, ids, ids)); opt.step()
    >>> store.stats.loads >= 3, store.stats.d2h_bytes > 0
    (True, True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref

import torch

from neutrain.compat.autograd import in_backward
from neutrain.compress import stream as kstream
from neutrain.nn import offload_debug

PAYLOAD = offload_debug.PAYLOAD  # ("stream", "tails", "lane_words", "tile_base")
_ALIGN = 256  # slot offsets: every view is aligned for the kernels' vector loads
_PAGE = 4096
_SLOT_HEADROOM = 1 / 16  # re-encoded streams grow a little; a slot regrows (with a sync) only past this


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def slot_layout(weights) -> tuple[list[tuple], int]:
    """``(weight, name, host tensor, byte offset)`` of each payload tensor of a layer in its slot (from
    the host sizes, so a grown stream gets its room), and the bytes they take."""
    layout, offset = [], 0
    for weight in weights:
        for name in PAYLOAD:
            host = weight._host[name]
            layout.append((weight, name, host, offset))
            offset += _aligned(_nbytes(host))
    return layout, offset


def slot_bytes(need: int) -> int:
    """Bytes allocated for a slot that must hold ``need`` (with headroom for re-encoded streams to grow)."""
    return int(need * (1 + _SLOT_HEADROOM))


@dataclasses.dataclass
class OffloadStats:
    """Copies made by a :class:`WeightOffload` since :meth:`reset`."""

    loads: int = 0  # layer payloads copied to the device
    stalls: int = 0  # fetches that found their layer not resident (no prefetch had started it)
    writebacks: int = 0  # weights copied back after a re-encode
    regrows: int = 0  # slots allocated again, larger (a layer's payload outgrew the slot; a device sync each)
    h2d_bytes: int = 0
    d2h_bytes: int = 0

    def reset(self) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)


class _Layer:
    def __init__(self, index: int, weights: list):
        self.index, self.weights = index, weights
        self.slot: int | None = None
        self.ready = None  # copy-stream event: payload in the slot
        self.done = None  # compute-stream event: last use by the compute stream enqueued before it
        self.flushed = None  # d2h-stream event: the last write-back of this layer
        self.wanted = 0  # LRU clock


class WeightOffload:
    """Host store of decoder layers' compressed payloads, streamed to ``device`` (see the module docstring).

    Args:
        device: where the weights are used (``cuda`` or ``cpu``).
        ahead: layers fetched ahead of the current one (at most ``slots - 1``).
        slots: device staging buffers (default ``ahead + 2``: the current layer, the one before, and those ahead).
    """

    def __init__(self, device, ahead: int = 2, slots: int | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        ahead = max(0, int(ahead))
        self.slots = max(2, slots if slots is not None else ahead + 2)
        # At most slots - 1 ahead: with more, each fetch's look-ahead evicts the layers it has just
        # loaded (12 layers, 2 slots, ahead 2: 542 layer copies in a training step instead of 22).
        self.ahead = min(ahead, self.slots - 1)
        self.layers: list[_Layer] = []
        self.stats = OffloadStats()
        self._buffers: list[torch.Tensor | None] = [None] * self.slots
        self._owner: list[_Layer | None] = [None] * self.slots
        self._current: _Layer | None = None
        self._clock = 0
        self._h2d = torch.cuda.Stream(self.device) if self.cuda else None
        self._d2h = torch.cuda.Stream(self.device) if self.cuda else None
        self._registered: list[int] = []  # host arenas pinned with cudaHostRegister (their addresses)
        # Registered memory must be unregistered before it is freed: at close(), or when the store goes.
        weakref.finalize(self, _unregister, self._registered)
        self.timeline: list | None = None  # set to [] to record (kind, layer, start, end) CUDA events per copy
        self.pinned_bytes = 0  # host memory taken (arenas with their room, and buffers of streams that outgrew it)
        self._empty = {dt: torch.empty(0, dtype=dt, device=self.device) for dt in (torch.int32, torch.uint8, torch.int64)}
        self.sync_debug = offload_debug.enabled()  # NEUTRAIN_OFFLOAD_SYNC_DEBUG: see neutrain.nn.offload_debug

    # ------------------------------------------------------------------ building
    def add_layer(self, weights) -> int:
        """Move ``weights`` (one decoder layer's compressed weights) into host memory; return the bytes pinned."""
        layer = _Layer(len(self.layers), list(weights))
        pinned = 0
        for weight in layer.weights:
            if weight.home is not None:
                raise ValueError(f"weight {weight.name} is already offloaded")
            if weight.group is not None:  # offloaded layers decode per weight, from their host payloads
                weight.group.dissolve()
            weight.home, weight._offload_layer, weight._flushed = self, layer, None
        pinned = self._to_host(layer.weights, {w: {n: getattr(w.ct, n) for n in PAYLOAD} for w in layer.weights})
        for weight in layer.weights:
            self._vacate(weight)
        self.layers.append(layer)
        return pinned

    def _to_host(self, weights, payloads) -> int:
        """Copy payloads into one new host arena (streams with 1/16 room to grow); return its bytes.

        One arena per layer, pinned by registering it with CUDA: the caching host allocator
        (``pin_memory=True``) rounds every block up to a power of two, which would pin up to
        twice the 87 GiB of a 70B's layers on a 128 GiB host.
        """
        rooms = [(w, n, t, _aligned(_nbytes(t) + (_nbytes(t) // 16 if n == "stream" else 0)))
                 for w in weights for n, t in payloads[w].items()]
        arena = self._arena(sum(room for *_, room in rooms))
        offset = 0
        for weight, name, t, room in rooms:
            if name == PAYLOAD[0]:
                weight._host, weight._room = {}, {}
            weight._host[name] = arena[offset:offset + _nbytes(t)].view(t.dtype).view(t.shape)
            weight._host[name].copy_(t)
            weight._room[name] = (arena, offset, room)
            offset += room
        return arena.numel()

    def _arena(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory, whole pages registered with CUDA (two registrations must not share a page)."""
        if not self.cuda or not nbytes:
            return torch.empty(nbytes, dtype=torch.uint8)
        size = -(-nbytes // _PAGE) * _PAGE
        raw = torch.empty(size + _PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % _PAGE
        arena = raw[start:start + size]
        code = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), size, 0)
        if int(code) != 0:
            raise RuntimeError(f"cudaHostRegister of {size} host bytes failed (CUDA error {int(code)})")
        self._registered.append(arena.data_ptr())
        self.pinned_bytes += size
        return arena[:nbytes]

    def close(self) -> None:
        """Unpin the host arenas (call before dropping the store; training with it must have ended)."""
        self.flush()
        _unregister(self._registered)

    def _vacate(self, weight) -> None:
        """Point the weight's payload at empty device tensors: any use without a fetch fails loudly."""
        for name in PAYLOAD:
            setattr(weight.ct, name, self._empty[weight._host[name].dtype])
        weight.ct._scratch = None  # encoder scratch: the allocator reuses it across layers

    @property
    def host_bytes(self) -> int:
        return sum(_nbytes(t) for layer in self.layers for w in layer.weights for t in w._host.values())

    @property
    def device_bytes(self) -> int:
        return sum(_nbytes(b) for b in self._buffers if b is not None)

    # ------------------------------------------------------------------ fetching
    def fetch(self, weight, writing: bool = False) -> None:
        """Make ``weight``'s layer resident and current; start copying the layers after it.

        ``writing``: a re-encode follows, which must not overwrite the payload while its last
        write-back (a step ago) may still read it.
        """
        layer = weight._offload_layer
        if layer.slot is None:
            self.stats.stalls += 1
            self._load(layer)
        self._make_current(layer)
        if layer.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(layer.ready)
            layer.ready = None
        if writing and weight._flushed is not None:
            torch.cuda.current_stream(self.device).wait_event(weight._flushed)
        step = -1 if in_backward() else 1
        for k in range(1, self.ahead + 1):
            j = layer.index + step * k
            if 0 <= j < len(self.layers):
                ahead = self.layers[j]
                self._clock += 1
                ahead.wanted = self._clock
                if ahead.slot is None:
                    self._load(ahead)
        if self.sync_debug:
            offload_debug.check(self, "fetch", weight)

    def decoded(self, weight) -> None:
        """After a decode of ``weight`` was enqueued (a no-op unless :attr:`sync_debug`)."""
        if self.sync_debug:
            offload_debug.check(self, "decode", weight)

    def _make_current(self, layer: _Layer) -> None:
        self._clock += 1
        layer.wanted = self._clock
        if self._current is layer:
            return
        if self._current is not None and self.cuda:
            # Everything the compute stream will do with the previous layer is enqueued by now.
            event = torch.cuda.Event(enable_timing=self.timeline is not None)
            event.record(torch.cuda.current_stream(self.device))
            self._current.done = event
            if self.timeline is not None:
                self.timeline.append(("compute", layer.index, event, None))  # the compute stream reaches this layer
        self._current = layer

    def _load(self, layer: _Layer) -> None:
        slot = next((i for i, owner in enumerate(self._owner) if owner is None), None)
        waits = []
        if slot is None:
            victim = min((o for o in self._owner if o is not self._current), key=lambda o: o.wanted)
            slot = victim.slot
            waits = [victim.done, victim.flushed]
            for weight in victim.weights:
                self._vacate(weight)
            victim.slot, victim.ready, victim.done = None, None, None
            self._owner[slot] = None  # free until this load is enqueued: an OOM below leaves a consistent ring
        layout, need = slot_layout(layer.weights)
        buffer = self._buffers[slot]
        fresh = buffer is None or buffer.numel() < need
        if fresh:
            if buffer is not None:
                self.stats.regrows += 1
                if self.cuda:
                    torch.cuda.synchronize(self.device)  # rare (a layer outgrew its headroom): no copy may still use it
            self._buffers[slot] = None
            buffer = self._buffers[slot] = torch.empty(slot_bytes(need), dtype=torch.uint8, device=self.device)
            if self.cuda:
                # Copies into it run on the copy stream: when the slot is freed (the store dropped with a
                # copy in flight), the allocator must not hand its block out before they are done.
                buffer.record_stream(self._h2d)
        waits.append(layer.flushed)  # this layer's last write-back reads its host buffers' new bytes
        # Taken before entering the copy stream's context: inside it, current_stream() *is* the copy
        # stream, and a wait on it is a no-op (the fault that the H100 showed at 4227e30: the test
        # below read 0.25 everywhere, the decode of a zeroed slot).
        compute = torch.cuda.current_stream(self.device) if self.cuda else None
        with torch.cuda.stream(self._h2d) if self.cuda else contextlib.nullcontext():
            if fresh and self.cuda:
                # The new slot was allocated on the compute stream, so the caching allocator may have
                # handed it a block that compute kernels enqueued before now still read or write (a
                # tensor freed on that stream is reusable there at once: stream order protects it, but
                # this copy runs on another stream). Without this wait those kernels and the copy can
                # overwrite each other, and a slot whose tile table holds other bytes sends the decode
                # kernel far out of its stream: the Llama-3-8B's and 70B's `illegal memory access` in
                # their first offloaded step (benchmarks/offload/NOTES.md; a tiny model's queue is too
                # short to lose the race). test_weight_offload_gpu.py forces it.
                self._h2d.wait_stream(compute)
            for event in waits:
                if event is not None:
                    self._h2d.wait_event(event)
            mark = self._mark()
            for weight, name, host, start in layout:
                view = buffer[start:start + _nbytes(host)].view(host.dtype)
                view.copy_(host, non_blocking=self.cuda)
                setattr(weight.ct, name, view)
            if self.cuda:
                layer.ready = torch.cuda.Event()
                layer.ready.record(self._h2d)
            self._log("h2d", layer, mark)
        layer.slot = slot
        self._owner[slot] = layer
        self.stats.loads += 1
        self.stats.h2d_bytes += sum(_nbytes(host) for _, _, host, _ in layout)

    def _mark(self):
        """A timing event on the current (copy) stream when a timeline is recorded."""
        if self.timeline is None or not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _log(self, kind: str, layer: _Layer, start) -> None:
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timeline.append((kind, layer.index, start, end))

    # ---------------------------------------------------------------- write-back
    def written(self, weight) -> None:
        """After a re-encode of ``weight`` on the device: copy its new payload to host memory (asynchronously)."""
        layer = weight._offload_layer
        if self.cuda:
            encoded = torch.cuda.Event()
            encoded.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h) if self.cuda else contextlib.nullcontext():
            if self.cuda:
                self._d2h.wait_event(encoded)
            mark = self._mark()
            for name in PAYLOAD:
                device = getattr(weight.ct, name)
                host = self._host_like(weight, name, device)
                host.copy_(device, non_blocking=self.cuda)
                if self.cuda:
                    device.record_stream(self._d2h)  # a grown stream is freed at eviction while this copy may run
                self.stats.d2h_bytes += _nbytes(device)
            if self.cuda:
                layer.flushed = weight._flushed = torch.cuda.Event()
                layer.flushed.record(self._d2h)
            self._log("d2h", layer, mark)
        self.stats.writebacks += 1
        if self.sync_debug:
            offload_debug.check(self, "write-back", weight)

    def _host_like(self, weight, name: str, device: torch.Tensor) -> torch.Tensor:
        """The host buffer for ``weight``'s new ``name`` tensor: as before, or resized within its room in
        the arena (a grown stream), or a new buffer when it outgrew the room; never a byte short."""
        host = weight._host[name]
        if host.shape == device.shape:
            return host
        arena, offset, room = weight._room[name]
        if _nbytes(device) <= room:
            host = arena[offset:offset + _nbytes(device)].view(device.dtype).view(device.shape)
        else:
            host = torch.empty(device.shape, dtype=device.dtype, pin_memory=self.cuda)
            weight._room[name] = (host.view(-1).view(torch.uint8), 0, _nbytes(host))
            self.pinned_bytes += _nbytes(host)
        weight._host[name] = host
        return host

    # ------------------------------------------------------------ saving, loading
    def synchronize(self) -> None:
        """Wait for every copy in flight (host buffers are then current)."""
        if self.cuda:
            self._h2d.synchronize()
            self._d2h.synchronize()

    def flush(self) -> None:
        """Wait for all copies and evict every layer (before reading or replacing the host store)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for slot, layer in enumerate(self._owner):
            if layer is not None:
                for weight in layer.weights:
                    self._vacate(weight)
                layer.slot = layer.ready = layer.done = layer.flushed = None
                self._owner[slot] = None
        self._current = None

    def host_ct(self, weight):
        """A ``CompressedTensor`` whose payload is the host store's (for saving: nothing goes to the device)."""
        self.synchronize()
        kstream.settle(weight.ct, wait=True)  # the used stream length of the last re-encode
        host = copy.copy(weight.ct)
        for name in PAYLOAD:
            setattr(host, name, weight._host[name])
        host._scratch = None
        # Its state_dict() holds views of the host store, not clones: saving a 70B must not copy its 88 GiB.
        return host

    def adopt(self, weight) -> None:
        """``weight`` got a new ``CompressedTensor`` (checkpoint loading): its payload becomes the host copy."""
        payload = {name: getattr(weight.ct, name) for name in PAYLOAD}  # before flush() vacates its layer
        if "stream" in payload:
            # The used words only, as a checkpoint holds them: a loaded stream comes with headroom, and a host
            # buffer sized for it could outgrow the weight's room in the arena and pin a second buffer.
            payload["stream"] = payload["stream"][: weight.ct.stream_words]
        self.flush()
        for name, tensor in payload.items():  # into the weight's room: a resumed 70B must not pin twice
            self._host_like(weight, name, tensor).copy_(tensor)
        self._vacate(weight)


def _unregister(addresses: list[int]) -> None:
    while addresses:
        torch.cuda.cudart().cudaHostUnregister(addresses.pop())
