"""Chunked lm_head + cross-entropy: the loss without ever materialising full logits.

``linear_cross_entropy(hidden, lm_head, labels)`` equals
``F.cross_entropy(lm_head(hidden).float(), labels)`` but walks the vocabulary in
chunks: forward keeps a running max and sum of exponentials per token (online
log-sum-exp) and saves only the per-token ``lse``; backward recomputes each
chunk's logits, forms ``softmax - onehot`` and produces that chunk's slice of
the weight gradient with one matrix product over all tokens, plus its
contribution to the hidden-state gradient. Peak extra memory is one
``tokens x chunk`` fp32 block (64 MiB by default) instead of
``tokens x vocab`` logits and their gradient (Llama-3: 128,256 columns; 1 GiB
per 2,048 tokens in fp32, as much again for the gradient; docs/trainer.md §5).

Chunking over the vocabulary (not over tokens) matters for fused updates: each
weight-gradient row block is complete after one product, so the full gradient
is assembled without an fp32 accumulator the size of the lm_head.

The lm_head may be a compressed :class:`~neutrain.nn.CompressedLinear` (the
gradient goes to the fused optimizer, tied embedding included) or a plain
``nn.Linear`` (the gradient flows to its parameter as usual, and from there to
a fused optimizer's hook or to ``.grad``).
"""

from __future__ import annotations

import contextlib

import torch

from neutrain.compat.masks import contiguous_positions
from neutrain.nn.architecture import LogitTransform, logit_transform, router_aux_loss
from neutrain.nn.linear import CompressedLinear
from neutrain.nn.row_blocks import rows_for_compute
from neutrain.optim.clipping import add_squared_norm_

IGNORE_INDEX = -100
DEFAULT_CHUNK_BYTES = 64 << 20


def _vocab_chunk(tokens: int, vocab: int, chunk_bytes: int) -> int:
    """Vocabulary rows per chunk: a power of two (so it tiles the optimizer's row blocks), or the vocab."""
    rows = max(1, chunk_bytes // max(1, 4 * tokens))
    return vocab if rows >= vocab else 1 << (rows.bit_length() - 1)


class _LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, dense_weight, key, compressed, labels, normaliser, chunk_bytes, ignore_index, transform,
                bias):
        tokens, vocab = hidden.shape[0], (compressed or dense_weight).shape[0]
        chunk = _vocab_chunk(tokens, vocab, chunk_bytes)
        # A compressed lm_head is read a tile-aligned block of chunks at a time, never decoded whole.
        w = rows_for_compute(compressed, chunk) if compressed is not None else dense_weight
        valid = labels != ignore_index
        safe_labels = torch.where(valid, labels, 0)
        running_max = torch.full((tokens,), -float("inf"), dtype=torch.float32, device=hidden.device)
        running_sum = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros(tokens, dtype=torch.float32, device=hidden.device)
        for start in range(0, vocab, chunk):
            logits = _chunk_logits(hidden, w, bias, start, start + chunk)
            if transform is not None:
                logits = transform.apply(logits)
            in_chunk = (safe_labels >= start) & (safe_labels < start + logits.shape[1])
            picked = logits.gather(1, (safe_labels - start).clamp(0, logits.shape[1] - 1)[:, None])[:, 0]
            target_logit = torch.where(in_chunk, picked, target_logit)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            # in place: one fp32 chunk buffer is the only tokens x chunk temporary
            chunk_sum = logits.sub_(new_max[:, None]).exp_().sum(1)
            running_sum = running_sum * torch.exp(running_max - new_max) + chunk_sum
            running_max = new_max
        if compressed is not None:
            compressed.release()
        lse = running_max + running_sum.log()
        losses = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
        loss = losses.sum() / normaliser
        ctx.save_for_backward(hidden, safe_labels, valid, lse, normaliser, dense_weight, bias)
        ctx.compressed, ctx.chunk, ctx.transform = compressed, chunk, transform
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, labels, valid, lse, normaliser, dense_weight, bias = ctx.saved_tensors
        compressed, transform = ctx.compressed, ctx.transform
        w = rows_for_compute(compressed, ctx.chunk) if compressed is not None else dense_weight
        vocab, chunk = w.shape[0], ctx.chunk
        row_scale = torch.where(valid, grad_loss / normaliser, torch.zeros_like(lse))[:, None]
        need_hidden = ctx.needs_input_grad[0]
        need_weight = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if need_hidden else None
        token_rows = torch.arange(hidden.shape[0], device=hidden.device)

        def grad_logits_of(start: int, stop: int) -> torch.Tensor:
            """(softmax - onehot) * scale for vocabulary rows [start, stop), in the hidden dtype."""
            raw = _chunk_logits(hidden, w, bias, start, stop)
            logits = raw if transform is None else transform.apply(raw)
            grad_logits = logits.sub_(lse[:, None]).exp_()  # softmax, in place (raw is kept when transformed)
            in_chunk = (labels >= start) & (labels < stop)
            local = (labels - start).clamp(0, stop - start - 1)
            grad_logits[token_rows, local] -= in_chunk.to(grad_logits.dtype)
            grad_logits.mul_(row_scale)
            if transform is not None:  # through soft-capping / logit scaling to the raw logits
                grad_logits = transform.backward(raw, grad_logits)
            return grad_logits.to(hidden.dtype)

        need_bias = ctx.needs_input_grad[9]
        # A bias gradient is summed over the full-gradient loop below; streaming is for bias-free heads.
        stream_rows = compressed.streamed_chunk_rows() if compressed is not None and need_weight and bias is None else None
        if stream_rows and (stream_rows % chunk == 0 or chunk % stream_rows == 0):
            _streamed_weight_update(compressed, grad_logits_of, hidden, w, grad_hidden, chunk, stream_rows)
            compressed.release()
            return _finish(grad_hidden, hidden), None, None, None, None, None, None, None, None, None

        grad_w = torch.empty(w.shape, dtype=w.dtype, device=w.device) if need_weight else None
        grad_bias = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if need_bias else None
        for start in range(0, vocab, chunk):
            stop = min(vocab, start + chunk)
            grad_logits = grad_logits_of(start, stop)
            if need_bias:
                grad_bias[start:stop] = grad_logits.sum(0)
            if need_hidden:
                grad_hidden += grad_logits.mm(w[start:stop]).float()
            if need_weight:
                torch.mm(grad_logits.t(), hidden, out=grad_w[start:stop])
        grad_dense = None
        if compressed is None:
            grad_dense = grad_w  # dense lm_head: autograd delivers it (to a hook or .grad)
        else:
            if need_weight:
                compressed.apply_grad(grad_w)  # tied, or a rule needing whole-tensor statistics
            compressed.release()
        return _finish(grad_hidden, hidden), grad_dense, None, None, None, None, None, None, None, grad_bias


def _streamed_weight_update(compressed, grad_logits_of, hidden, w, grad_hidden, chunk: int, block: int) -> None:
    """Update the lm_head from recomputed weight-gradient blocks; the full gradient never exists.

    The optimizer updates rows in blocks of ``block``; the loss computes vocabulary
    chunks of ``chunk`` (one divides the other). Work goes by *units* of
    ``max(block, chunk)`` rows, each filled chunk by chunk with the same products
    the full-gradient path runs, so every value (gradient rows, the hidden-state
    gradient, the norm summed block by block) is bit-identical to it.

    Single pass when the optimizer needs no norm before the update (``global_stale``,
    ``none``: :meth:`~neutrain.optim.streamed.StreamedUpdates.apply_`): it requests
    the blocks in order, each unit is computed once, with its hidden-state gradient,
    and the norm is summed on the way; the lm_head gradient costs what the
    full-gradient path's does. Otherwise (``per_tensor``, a norm pass) the optimizer
    first calls ``measure`` (every unit: hidden-state gradient and squared norm), then
    recomputes each unit once for its rows: two extra lm_head products. Either way a
    block's weight rows are still unchanged when its gradient is computed, since the
    logits of a chunk only involve that chunk's rows; the buffer is ``unit x hidden``
    instead of a ``vocab x hidden`` gradient.
    """
    vocab = w.shape[0]
    unit = max(block, chunk)
    buffer = torch.empty((min(unit, vocab), w.shape[1]), dtype=w.dtype, device=w.device)

    def fill(unit_start: int, with_hidden_grad: bool) -> torch.Tensor:
        unit_stop = min(vocab, unit_start + unit)
        for start in range(unit_start, unit_stop, chunk):
            stop = min(unit_stop, start + chunk)
            grad_logits = grad_logits_of(start, stop)
            if with_hidden_grad and grad_hidden is not None:
                grad_hidden.add_(grad_logits.mm(w[start:stop]).float())
            torch.mm(grad_logits.t(), hidden, out=buffer[start - unit_start : stop - unit_start])
        return buffer[: unit_stop - unit_start]

    measured = {"done": False}
    filled_once: list[int] = []  # units filled with their hidden-state gradient in the single pass

    def measure() -> torch.Tensor:
        sumsq = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for unit_start in range(0, vocab, unit):
            filled = fill(unit_start, with_hidden_grad=True)
            for start in range(0, filled.shape[0], block):
                add_squared_norm_(sumsq, filled[start : start + block])
        measured["done"] = True
        return sumsq

    current = {"unit": None}

    def grad_rows(rows: slice) -> torch.Tensor:
        unit_start = rows.start - rows.start % unit
        if current["unit"] != unit_start:
            single_pass = not measured["done"]
            fill(unit_start, with_hidden_grad=single_pass)
            if single_pass:
                filled_once.append(unit_start)
            current["unit"] = unit_start
        return buffer[rows.start - unit_start : min(rows.stop, vocab) - unit_start]

    compressed.apply_streamed_grad(grad_rows, measure)
    if not measured["done"] and filled_once != list(range(0, vocab, unit)):
        # the hidden-state gradient comes from these products: every unit, once, or it is wrong
        raise RuntimeError(f"streamed lm_head update: units {filled_once[:4]}... filled, not each of 0..{vocab} once")


def _chunk_logits(hidden, w, bias, start: int, stop: int) -> torch.Tensor:
    """fp32 logits of vocabulary rows [start, stop), computed as ``nn.Linear`` does (addmm with a bias)."""
    if bias is None:
        return hidden.mm(w[start:stop].t()).float()
    return torch.addmm(bias[start:stop], hidden, w[start:stop].t()).float()


def _finish(grad_hidden: torch.Tensor | None, hidden: torch.Tensor) -> torch.Tensor | None:
    return None if grad_hidden is None else grad_hidden.to(hidden.dtype)


def linear_cross_entropy(
    hidden: torch.Tensor,
    lm_head: torch.nn.Module,
    labels: torch.Tensor,
    *,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    logit_transform: LogitTransform | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy of ``lm_head(hidden)`` against ``labels``, in vocabulary chunks.

    Args:
        hidden: ``(..., hidden_size)`` final hidden states.
        lm_head: a :class:`CompressedLinear` or ``nn.Linear`` (a bias, as Phi's, is added per chunk).
        labels: integer targets with the shape of ``hidden[..., 0]``; ``ignore_index`` masks.
        num_items_in_batch: if given, divide the summed loss by it (Hugging Face's
            convention for token-normalised losses); else by the number of valid labels.
        ignore_index: label that contributes nothing.
        chunk_bytes: fp32 logits budget per chunk.
        logit_transform: what the model applies to its logits before the loss (soft-capping,
            logit scales: :func:`neutrain.nn.architecture.logit_transform`); None for none.

    Returns:
        A 0-dim fp32 loss.

    Example:
        >>> head = torch.nn.Linear(8, 50, bias=False)
        >>> h, y = torch.randn(6, 8), torch.randint(0, 50, (6,))
        >>> ref = torch.nn.functional.cross_entropy(head(h), y)
        >>> bool(torch.allclose(linear_cross_entropy(h, head, y, chunk_bytes=6 * 4 * 7), ref, atol=1e-6))
        True
    """
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    labels1 = labels.reshape(-1).to(hidden2.device)
    if num_items_in_batch is None:
        normaliser = (labels1 != ignore_index).sum().clamp(min=1).to(torch.float32)
    else:
        normaliser = torch.as_tensor(num_items_in_batch, dtype=torch.float32, device=hidden2.device)
    if isinstance(lm_head, CompressedLinear):
        compressed, key, dense_weight = lm_head.compressed, lm_head.weight_key, None
    else:
        compressed, key, dense_weight = None, None, lm_head.weight
    transform = None if logit_transform is None or logit_transform.identity else logit_transform
    return _LinearCrossEntropyFunction.apply(
        hidden2, dense_weight, key, compressed, labels1, normaliser, chunk_bytes, ignore_index, transform,
        getattr(lm_head, "bias", None),
    )


def causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    **model_kwargs,
) -> torch.Tensor:
    """Next-token loss of a Hugging Face causal LM through the chunked lm_head.

    Runs the decoder (``model.get_decoder()``), shifts labels left by one (as
    transformers' ``ForCausalLMLoss``) and applies :func:`linear_cross_entropy`
    with ``model.get_output_embeddings()`` and the logits transform the model's own
    forward applies (soft-capping, logit scales: :mod:`neutrain.nn.architecture`), plus
    the MoE router's load-balancing loss when ``config.output_router_logits`` is set.

    Example:
        >>> from transformers import LlamaConfig, AutoModelForCausalLM
        >>> cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=1, vocab_size=40)
        >>> model = AutoModelForCausalLM.from_config(cfg)
        >>> ids = torch.randint(0, 40, (2, 5))
        >>> ref = model(input_ids=ids, labels=ids).loss
        >>> bool(torch.allclose(causal_lm_loss(model, ids, ids), ref, atol=1e-5))
        True
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    aux = router_aux_loss(model)
    if aux is not None:
        model_kwargs = {**model_kwargs, "output_router_logits": True}
    # Positions left to the model and no mask: one sequence per row, so transformers' packed-sequence
    # probe (a host read per forward) has nothing to find (neutrain.compat.masks).
    contiguous = attention_mask is None and model_kwargs.get("position_ids") is None
    # No cache: a loss forward reads none. Why it matters: a model whose config says use_cache (Llama's does) builds
    # one unless activation checkpointing turns it off, and with a cache transformers skips its packed-sequence
    # check, so packed documents attended to the ones before them in the row.
    model_kwargs = {"use_cache": False, **model_kwargs}
    with contiguous_positions() if contiguous else contextlib.nullcontext():
        outputs = decoder(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = linear_cross_entropy(
        outputs.last_hidden_state, model.get_output_embeddings(), shifted, num_items_in_batch=num_items_in_batch,
        chunk_bytes=chunk_bytes, logit_transform=logit_transform(model.config) if hasattr(model, "config") else None,
    )
    if aux is not None:  # as the model's forward: loss += coef * load-balancing loss
        loss = loss + aux(outputs.router_logits, attention_mask).to(loss.device)
    return loss
