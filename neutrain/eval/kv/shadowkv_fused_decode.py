"""ShadowKV's fused decode step, the cache's side: the tail in a fixed-capacity buffer, and the one-token step
through :func:`neutrain.kernels.shadowkv_fused_decode.shadowkv_fused_decode` (``ShadowKVOptions.fused_decode``).

Why a buffer: the unfused path grows the tail (local window and generated tokens) with ``torch.cat`` each step,
so each step's shapes differ and a captured CUDA graph would hold one length only. Here the tail's length lives
on the device (``tail_len``), new tokens are written at it with ``index_copy_`` and the kernel reads up to it:
the step has the same shapes and arguments every time, and asks the host for nothing. The host keeps its own
count (``tail_count``) for what is read off the host anyway (the ``tail_k``/``tail_v`` views, the accounting,
when the buffer is full); it never reads the device's.

The phases a step marks keep the unfused path's names, so ``kv_eval``'s step split reads both: ``reconstruction``
is empty (the keys are rebuilt inside the kernel) and ``attention`` is the kernel.
"""

from __future__ import annotations

import torch


class FusedDecodeLayer:
    """The fused path's part of :class:`neutrain.eval.kv.shadowkv.ShadowKVLayer` (a mixin: it uses the layer's
    ``owner``, ``tail_k``/``tail_v``, low-rank factors, outliers and ``pos0``)."""

    # None until the first fused step moves the tail into buffers; the tail is then ``_tail_kbuf``/``_tail_vbuf``
    # [b, h, capacity, d] up to ``tail_len`` (int32 [1], on the device) == ``tail_count`` (on the host).
    tail_len: torch.Tensor | None = None
    tail_count: int = 0

    def _tail_buffers(self) -> None:
        """Move the tail into buffers with ``tail_capacity`` free slots and a device-side length."""
        b, h, n, d = self.tail_k.shape
        cap = n + max(1, self.owner.options.tail_capacity)
        kbuf, vbuf = self.tail_k.new_empty(b, h, cap, d), self.tail_v.new_empty(b, h, cap, d)
        kbuf[:, :, :n], vbuf[:, :, :n] = self.tail_k, self.tail_v
        self._tail_kbuf, self._tail_vbuf = kbuf, vbuf
        self.tail_len = torch.full((1,), n, dtype=torch.int32, device=kbuf.device)
        self.tail_count = n
        self.tail_k, self.tail_v = kbuf[:, :, :n], vbuf[:, :, :n]

    def append_tail(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write new tokens at the device-held length: a replayed step writes where that step's length says, not
        where a captured host offset did. Out of free slots, the buffers are reallocated (the host's count says
        when: no read of the device)."""
        m = key_states.shape[-2]
        if self.tail_count + m > self._tail_kbuf.shape[2]:
            self._tail_buffers()  # tail_k/tail_v are the views of the used part: copied into larger buffers
        at = self.tail_len.long() + torch.arange(m, device=self.tail_len.device)
        self._tail_kbuf.index_copy_(2, at, key_states.to(self._tail_kbuf.dtype))
        self._tail_vbuf.index_copy_(2, at, value_states.to(self._tail_vbuf.dtype))
        self.tail_len += m
        self.tail_count += m
        self.tail_k = self._tail_kbuf[:, :, : self.tail_count]
        self.tail_v = self._tail_vbuf[:, :, : self.tail_count]

    def tail_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the tail holds on the device: the buffers once there are any, else the grown tensors."""
        if self.tail_len is not None:
            return self._tail_kbuf, self._tail_vbuf
        return self.tail_k, self.tail_v

    def fused_attention(self, module, query, rotary, chunk_ids, blocks, pending) -> torch.Tensor:
        """The one-token step from the selected ``chunk_ids`` and their value ``blocks`` (joined once the side
        stream's gather, ``pending``, is waited for), or with ``blocks`` None read by the kernel from the value
        stores (``fused_store_reads``): ``[b, 1, hq, d]``, as the unfused path returns."""
        from ...kernels.shadowkv_fused_decode import shadowkv_fused_decode  # lazy: Triton

        mark = self.owner.mark
        if self.tail_len is None:
            self._tail_buffers()
        mark("reconstruction")
        if pending is not None:
            torch.cuda.current_stream(query.device).wait_stream(pending)
        stores = None
        if blocks is None:  # host rows first (v_store), the device rows after (v_device); or all on the device
            stores = (self.v_store, self.v_device) if self.offloaded else (None, self.v_store)
            values_sel = None
        else:
            values_sel = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        mark("gather_wait")
        out = shadowkv_fused_decode(query[:, :, 0], self.u, self.sv, chunk_ids, values_sel, self.outlier_k,
                                    self.outlier_v, self._tail_kbuf, self._tail_vbuf, self.tail_len, self.pos0,
                                    rotary, self.chunk_size, module.scaling, value_stores=stores)
        counters = self.owner.counters
        counters["sparse_steps"] += 1
        counters["fused_steps"] += 1
        counters["selected_chunks"] += int(chunk_ids.numel())  # a host-side size: no read of the device
        mark("attention")
        return out[:, None]
