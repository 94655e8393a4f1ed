"""A decode engine: static KV cache, sampling on the device, one CUDA graph per decode step.

Hugging Face's ``generate`` spends most of a small model's decode step on the host: Python per
layer, a growing cache, logits processors, and a host synchronisation per token for the stopping
check. :class:`DecodeEngine` runs the model's own forward with

* a **static KV cache** (transformers' ``StaticCache``: ``[batch, kv_heads, max_len, head_dim]`` per
  layer in the model's dtype, written in place at the cache's device-side length,
  :mod:`neutrain.compat.static_cache`);
* an explicit **4D additive mask** over all ``max_len`` columns built on the device from that length
  (stale columns past the length are hidden), and ``position_ids`` from the same tensor, so one
  decode step has fixed shapes and no Python number that changes from token to token;
* **tokens in a preallocated device buffer** ``tokens[batch, max_len]``: a step reads the token at
  the current length and writes the next one after it;
* **fused projections** (:mod:`neutrain.decode.fused_projections`): each layer's Q/K/V and gate/up
  run as one GEMV each (the fused matrices replace the model's weight storage, not duplicate it;
  by default for frozen models, ``fuse=True`` for any);
* **sampling on the device**: argmax at temperature 0, else the exponential race
  ``argmax(logits / T - log E)``, ``E ~ Exp(1)`` i.i.d. from the engine's seeded generator, which draws
  exactly from ``softmax(logits / T)`` (it is the Gumbel-max trick).

On CUDA the step is captured once per sampling mode in a ``torch.cuda.CUDAGraph`` (warm-up on a side
stream first) and each token is one ``replay()``; on CPU the same function runs eagerly. ``generate``
synchronises with the host only every ``check_every`` tokens when an EOS token is given, and once at
the end to cut the output after EOS. Design notes: docs/specdec.md §11.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch

from neutrain.compat import cache_forward_kwarg
from neutrain.compat.static_cache import (
    new_static_cache,
    register_graph_generator,
    set_static_cache_length,
    static_cache_length,
    static_cache_tensors,
)
from neutrain.decode.compiled_layers import CompiledLayers
from neutrain.decode.fused_projections import fuse_projections, projection_fusion
from neutrain.decode.gemv import GemvDispatch
from neutrain.decode.truncation import check_truncation, truncate
from neutrain.decode.zgemv import attach_zgemv, zgemv_decoding

#: Eager runs of the step on a side stream before capture (cuBLAS/cuDNN workspaces, lazy inits).
WARMUP_STEPS = 3


@contextlib.contextmanager
def allowed_sync() -> Iterator[None]:
    """Let the enclosed code synchronise with the host even under ``torch.cuda.set_sync_debug_mode("error")``.

    The engine wraps its deliberate synchronisations (the EOS check, the final cut) in this, so a test
    that turns the debug mode on sees every other synchronisation as an error.
    """
    # Setting the mode at all makes torch warn that it is a prototype ("UserWarning: Synchronization debug
    # mode ..." in every `neutrain generate`): left alone when it is off, as it is outside such a test.
    previous = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    if previous == 0:
        yield
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor | None, generator: torch.Generator | None,
                  top_k: int = 0, top_p: float = 1.0):
    """Next tokens ``[B]`` from ``logits [B, V]``: argmax if ``temperature`` is None, else a draw from
    ``softmax(logits / temperature)`` (exponential race in float64; no host synchronisation), truncated to the
    top ``top_k`` tokens and the ``top_p`` nucleus first when asked (:mod:`neutrain.decode.truncation`: as
    transformers does, on the float32 scores).

    Example:
        >>> import torch
        >>> sample_tokens(torch.tensor([[0.0, 3.0, 1.0]]), None, None).tolist()
        [1]
    """
    if temperature is None:
        return logits.argmax(-1)
    race = torch.empty(logits.shape, dtype=torch.float64, device=logits.device).exponential_(generator=generator)
    if top_k or top_p < 1.0:
        scores = truncate(logits.float() / temperature.float(), top_k, top_p).to(torch.float64)
    else:
        scores = logits.to(torch.float64) / temperature
    return (scores - race.log()).argmax(-1)


@functools.cache
def _cache_keyword(model_class) -> str:
    return cache_forward_kwarg(model_class)  # ``forward``'s signature, read once per class


def cache_kwargs(model, cache) -> dict:
    """``{keyword: cache}`` for ``model.forward`` (``past_key_values`` or ``cache``), memoised per class.

    Example:
        >>> # out = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    """
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _takes_logits_to_keep(model_class) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def _compute_dtype(model) -> torch.dtype:
    # transformers' ``model.dtype`` is the compute dtype even when the first parameter is a
    # compressed integer buffer (NeuZip); the cache and the mask must match the activations.
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    return dtype if dtype.is_floating_point else torch.float32


class DecodeEngine:
    """Autoregressive decoding of a Hugging Face causal LM with a static cache and CUDA graphs.

    Args:
        model: a transformers causal LM whose layers all use full attention (dense or NeuZip-compressed).
        max_len: the most tokens a sequence may hold (prompt plus generated).
        batch: rows decoded together; their prompts have equal length.
        seed: seed of the engine's sampling generator (on the model's device).
        cuda_graph: capture the decode step in a CUDA graph; default: on CUDA devices.
        fuse: fuse each layer's Q/K/V and gate/up projections into one GEMV each
            (:mod:`neutrain.decode.fused_projections`: the fused matrices replace the model's own weight
            storage; the model still trains and saves as before); ``fused_groups`` counts them.
            Default (None): only when no parameter requires grad. A model being trained may keep its
            parameters aliased elsewhere (FSDP's flat parameters, a trainer's flat buffer), which
            re-pointing them at the fused matrices would break, so there fusion is asked for explicitly.
        gemv: ``{(N, K): (block_n, block_k, split)}``: one-row, bias-free linears of these weight shapes run
            the split-K Triton GEMV (:class:`~neutrain.decode.gemv.GemvDispatch`; the table comes from
            ``benchmarks/decode/engine_decode.py``'s timing); default: cuBLAS for every linear.
        zgemv: for a NeuZip model: True, or ``{(N, K): (block_n, block_k, split, num_warps, prmt)}``, converts each
            compressed bf16 matrix (fused groups as one) to the 12-bit zgemv layout once, and decode steps read
            it through ``zgemv``, decoded in registers, instead of decoding the matrix to bf16 first
            (:mod:`neutrain.decode.zgemv`; about 12 more bits a weight while the engine's model holds them);
            ``zgemv_matrices`` counts them. Inputs of more than 8 rows (a prefill) keep the compressed path.
            ``"replace"``: the serving mode, the layouts replacing the NeuZip payloads (freed; about 12 bits a
            weight in all; a prefill decodes each matrix to bf16 from its layout; ``detach_zgemv(model)`` gives
            the exact payloads back). Default: off.
        compile_layers: run the one-token decode step through the decoder layers compiled by ``torch.compile``
            (:mod:`neutrain.decode.compiled_layers`: each run of small pointwise kernels fused into one); the
            prefill and calls of more tokens stay eager. Logits may then differ from the eager layers' in the
            last bits. Default: off.

    Example:
        >>> engine = DecodeEngine(model, max_len=256)  # doctest: +SKIP
        >>> out = engine.generate(prompt_ids, max_new_tokens=64, temperature=0)  # doctest: +SKIP
        >>> # out == model.generate(prompt_ids, max_new_tokens=64, do_sample=False), token for token
    """

    def __init__(self, model, max_len: int, batch: int = 1, *, seed: int = 0, cuda_graph: bool | None = None,
                 fuse: bool | None = None, gemv: dict | None = None, zgemv: bool | str | dict | None = None,
                 compile_layers: bool = False):
        if max_len < 2 or batch < 1:
            raise ValueError(f"max_len must be >= 2 and batch >= 1 (got max_len={max_len}, batch={batch})")
        self.model, self.max_len, self.batch = model, int(max_len), int(batch)
        self.device = next(model.parameters()).device
        self.dtype = _compute_dtype(model)
        self.use_graph = self.device.type == "cuda" if cuda_graph is None else bool(cuda_graph)
        if self.use_graph and self.device.type != "cuda":
            raise ValueError("cuda_graph=True needs the model on a CUDA device")
        self.cache = new_static_cache(model, self.batch, self.max_len, self.dtype, self.device)
        self.length = static_cache_length(self.cache)  # positions cached, on the device
        self.tokens = torch.zeros(self.batch, self.max_len, dtype=torch.long, device=self.device)
        self.logits: torch.Tensor | None = None  # the last forward's next-token logits [batch, V], fp32
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._columns = torch.arange(self.max_len, device=self.device)
        self._temperature = torch.ones((), dtype=torch.float64, device=self.device)
        self._greedy = True
        self._truncation = (0, 1.0)  # (top_k, top_p) of the sampling mode; (0, 1.0) = none
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.host_length = 0  # the same length, counted on the host (no synchronisation needed)
        if fuse is None:
            fuse = not any(p.requires_grad for p in model.parameters())
        self.fused_groups = fuse_projections(model) if fuse else 0
        self.gemv = GemvDispatch(gemv) if gemv else None
        if isinstance(zgemv, str) and zgemv != "replace":
            raise ValueError(f"zgemv must be True, 'replace' or a table of configurations, got {zgemv!r}")
        # Before any capture: a graph must never hold a decode of a payload that the replace mode frees.
        self.zgemv_matrices = attach_zgemv(model, zgemv if isinstance(zgemv, dict) else None,
                                           release=zgemv == "replace") if zgemv else 0
        self.compiled_layers = CompiledLayers(model) if compile_layers else None

    # --- the model call shared by prefill, the decode step and verification ---

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, last_only: bool = True,
                blocked: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``input_ids [batch, q]`` at ``positions [q]`` (device) on top of the cache.

        Returns logits ``[batch, q, V]``, or ``[batch, 1, V]`` for the last query with ``last_only``.
        The cache's update writes the new keys at columns ``length + i``. By default query ``i``
        attends to the columns up to ``positions[i]`` (a plain continuation has ``positions =
        length + arange(q)``); ``blocked [q, max_len]`` (True = hidden) replaces that, e.g. for a
        token tree whose rotary positions differ from its columns.
        """
        q = input_ids.shape[1]
        if blocked is None:
            blocked = self._columns[None, :] > positions.view(q, 1)
        mask = torch.zeros(q, self.max_len, dtype=self.dtype, device=self.device)
        mask.masked_fill_(blocked, torch.finfo(self.dtype).min)
        extra = {"logits_to_keep": int(last_only)} if _takes_logits_to_keep(type(self.model)) else {}
        fusion = projection_fusion(self.model) if self.fused_groups else contextlib.nullcontext()
        compressed = zgemv_decoding(self.model) if self.zgemv_matrices else contextlib.nullcontext()
        compiled = self.compiled_layers.active(q) if self.compiled_layers is not None else contextlib.nullcontext()
        with fusion, compressed, compiled, self.gemv if self.gemv is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids,
                attention_mask=mask[None, None].expand(self.batch, 1, q, self.max_len),
                position_ids=positions.view(1, q).expand(self.batch, q),
                use_cache=True,
                **cache_kwargs(self.model, self.cache),
                **extra,
            )
        return out.logits[:, -1:] if last_only else out.logits

    def _set_mode(self, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        check_truncation(top_k, top_p)
        self._greedy = temperature == 0
        self._truncation = (top_k, float(top_p))
        if not self._greedy:
            self._temperature.fill_(float(temperature))

    def _sample_after(self, logits: torch.Tensor, index: torch.Tensor) -> None:
        """Keep ``logits [batch, V]`` and write the sampled next tokens at column ``index`` (a 1-element tensor)."""
        if self.logits is None:
            self.logits = torch.empty(logits.shape, dtype=torch.float32, device=self.device)
        self.logits.copy_(logits)
        nxt = sample_tokens(self.logits, None if self._greedy else self._temperature, self.generator, *self._truncation)
        self.tokens.index_copy_(1, index, nxt[:, None])

    # --- cache surgery for speculative decoding (host-known lengths, device-side copies) ---

    def set_length(self, length: int) -> None:
        """Forget every cached column from ``length`` on (the next forward writes there)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside 0..{self.max_len}")
        set_static_cache_length(self.cache, length)
        self.host_length = length

    def keep_columns(self, start: int, columns: torch.Tensor) -> None:
        """Move cache ``columns`` (sorted, all >= ``start``) to ``start, start + 1, ...`` and cut the length there.

        Speculative decoding keeps the accepted path of a verified token tree this way.
        """
        columns = columns.to(self.device)
        end = start + columns.numel()
        for keys, values in static_cache_tensors(self.cache):
            keys[:, :, start:end] = keys.index_select(2, columns)
            values[:, :, start:end] = values.index_select(2, columns)
        self.set_length(end)

    def copy_row(self, row: int, start: int, end: int) -> None:
        """Copy batch row ``row``'s columns ``start:end`` into every row (a draft keeps its accepted branch)."""
        for keys, values in static_cache_tensors(self.cache):
            keys[:, :, start:end] = keys[row : row + 1, :, start:end].clone()
            values[:, :, start:end] = values[row : row + 1, :, start:end].clone()

    # --- public API ---

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
        """Start a new sequence: cache ``input_ids [batch, n]`` and sample the first new token (``top_k`` and
        ``top_p`` truncate the sampling law at T > 0, as transformers' warpers do).

        Returns the new tokens ``[batch]`` (a view of the token buffer, still on the device).
        """
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch:
            raise ValueError(f"input_ids must be [batch={self.batch}, n], got {tuple(input_ids.shape)}")
        n = input_ids.shape[1]
        if not 1 <= n < self.max_len:
            raise ValueError(f"a prompt of {n} tokens does not leave room in max_len={self.max_len}")
        self._set_mode(temperature, top_k, top_p)
        set_static_cache_length(self.cache, 0)
        self.tokens[:, :n].copy_(input_ids)
        positions = self._columns[:n]
        logits = self.forward(self.tokens[:, :n], positions)[:, -1]
        self._sample_after(logits, self._columns[n : n + 1])
        self.host_length = n
        return self.tokens[:, n]

    def _step_body(self) -> None:
        """One token: forward the token at the cache's length, sample the next one after it."""
        position = self.length.clone().view(1)  # the forward advances ``self.length`` in place
        logits = self.forward(self.tokens.index_select(1, position), position)[:, -1]
        self._sample_after(logits, position + 1)

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """Decode one token for every row; returns them ``[batch]`` (a device view, no synchronisation)."""
        if self.logits is None:
            raise RuntimeError("call prefill() before step()")
        if self.host_length + 1 >= self.max_len:
            raise ValueError(f"the sequence would exceed max_len={self.max_len}")
        if self.use_graph:
            graph = self._graphs.get(self._mode_key())
            if graph is None:
                with allowed_sync():  # once per engine and mode: capture synchronises the device
                    graph = self._capture()
            graph.replay()
        else:
            self._step_body()
        self.host_length += 1
        return self.tokens[:, self.host_length]

    def _mode_key(self) -> tuple:
        """One captured graph per sampling mode: greedy, or sampling with its truncation (baked into the graph)."""
        return (True,) if self._greedy else (False, *self._truncation)

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture :meth:`_step_body` for the current sampling mode (the state is left as it was)."""
        start = self.length.clone()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):  # each warm-up decodes the same position again
                self._step_body()
                set_static_cache_length(self.cache, start)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        register_graph_generator(graph, self.generator)
        with torch.cuda.graph(graph, pool=self._pool):
            self._step_body()  # recorded, not run: the state is still ``start``
        self._graphs[self._mode_key()] = graph
        return graph

    @torch.no_grad()
    def decode_after_prefill(self, n: int, max_new_tokens: int, eos_token_id: int | None = None,
                             check_every: int = 32) -> None:
        """Decode until the sequence holds ``max_new_tokens`` new tokens after its ``n``-token prompt
        (:meth:`prefill` made the first), or every row has produced ``eos_token_id``: the host looks
        only every ``check_every`` tokens, so rows may run a few tokens past their EOS."""
        for made in range(self.host_length - n + 1, max_new_tokens):
            if eos_token_id is not None and made % check_every == 0:
                with allowed_sync():
                    if bool((self.tokens[:, n : n + made] == eos_token_id).any(1).all()):
                        break
            self.step()

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        eos_token_id: int | None = None,
        pad_token_id: int = 0,
        check_every: int = 32,
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> torch.Tensor:
        """Prompt plus up to ``max_new_tokens`` tokens, ``[batch, n + new]`` on the model's device.

        As Hugging Face's ``generate``: a row stops at ``eos_token_id`` (later columns hold
        ``pad_token_id``) and the output ends where the last row stopped. Decoding runs on
        without host synchronisation; with an EOS token the host looks every ``check_every``
        tokens whether every row has ended, and once at the end to cut the output.
        """
        n = input_ids.shape[1]
        if max_new_tokens < 1 or n + max_new_tokens > self.max_len:
            raise ValueError(f"{n} prompt + {max_new_tokens} new tokens do not fit max_len={self.max_len}")
        self.prefill(input_ids, temperature, top_k, top_p)
        self.decode_after_prefill(n, max_new_tokens, eos_token_id, check_every)
        out = self.tokens[:, : self.host_length + 1].clone()
        if eos_token_id is None:
            return out
        return _cut_after_eos(out, n, eos_token_id, pad_token_id)


def _cut_after_eos(out: torch.Tensor, n: int, eos_token_id: int, pad_token_id: int) -> torch.Tensor:
    """Pad each row after its first EOS (in the new tokens) and drop the columns no row needs."""
    new = out[:, n:]
    is_eos = new == eos_token_id
    after = (is_eos.cumsum(1) - is_eos.long()) > 0  # strictly after the row's first EOS
    new.masked_fill_(after, pad_token_id)
    ended = is_eos.any(1)
    first = torch.where(ended, is_eos.long().argmax(1), new.shape[1] - 1)
    with allowed_sync():
        keep = int(first.max()) + 1
    return out[:, : n + keep]
