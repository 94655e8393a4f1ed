"""The fused-update optimizer base: apply each gradient the moment it exists.

LOMO's idea (docs/trainer.md §1, §3, §7): instead of keeping every gradient until
``optimizer.step()``, update each weight inside backward and free its gradient
at once, so at most a layer's gradient is alive. This base class holds what all
fused rules share; subclasses (:class:`~neutrain.optim.LOMO`,
:class:`~neutrain.optim.AdaLomo`, :class:`~neutrain.optim.AdamWInBackward`) only
write the per-tensor arithmetic.

Two ways a gradient reaches the optimizer, one code path:

* dense trainable parameters: :meth:`FusedOptimizer.bind` registers
  ``register_post_accumulate_grad_hook`` (fires once per backward, after all
  contributions, tied uses included, are summed into ``.grad``);
* compressed weights (``neutrain.nn``) never get a ``.grad``: their backward
  calls :meth:`FusedOptimizer.consume_grad_` with a *weight I/O* object that
  decodes the weight and re-encodes it after the update.

The optimizer is a real ``torch.optim.Optimizer``: ``param_groups`` hold ``lr``
and ``weight_decay`` and are read live at every update, so Hugging Face and torch
schedulers work; ``state`` is keyed by parameter and survives
``state_dict()``/``load_state_dict()``. ``step()`` does only end-of-step
bookkeeping (norms, counters, non-finite report); it never touches weights.

Memory: every update runs on row chunks of at most ``chunk_numel`` elements, so
the fp32 temporaries of one update are bounded (64 MiB each by default) whatever
the tensor size (a Llama-3 lm_head has 525 M elements).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from typing import Iterable, Protocol

import torch

from neutrain.compat.autograd import in_backward
from neutrain.optim.clipping import ClipMode, as_rows, clip_coefficient, squared_norm
from neutrain.optim.rounding import SeededGenerators, stochastic_round_to_bf16

logger = logging.getLogger(__name__)

# Attribute set on placeholder parameters that stand for compressed weights (see neutrain.nn).
COMPRESSED_KEY_ATTR = "_neutrain_compressed_key"


class WeightIO(Protocol):
    """Access to the storage of one weight, for an update.

    ``read()`` returns a contiguous tensor that the optimizer updates in place;
    ``write_(t)`` stores it back (a no-op for dense parameters, a re-encode for
    compressed ones).
    """

    def read(self) -> torch.Tensor: ...

    def write_(self, weight: torch.Tensor) -> None: ...


class DenseWeightIO:
    """Weight I/O for an ordinary parameter: updates land in ``param.data`` directly."""

    def __init__(self, param: torch.Tensor):
        self.param = param

    def read(self) -> torch.Tensor:
        return self.param.data

    def write_(self, weight: torch.Tensor) -> None:
        if weight.data_ptr() != self.param.data.data_ptr():
            self.param.data.copy_(weight)


class FusedOptimizer(torch.optim.Optimizer):
    """Base class of optimizers whose update runs inside backward.

    Args:
        params: parameters or parameter groups, as for any torch optimizer. Pass
            ``model.parameters()``: placeholders of compressed weights are
            parameters too, so they get param groups, lr schedules and state.
        defaults: per-group hyperparameters (must contain ``lr`` and ``weight_decay``).
        clip_mode: ``"none"``, ``"per_tensor"``, ``"global_stale"`` or
            ``"global_exact"`` (see :mod:`neutrain.optim.clipping`).
        max_grad_norm: clipping threshold; ``None`` or ``<= 0`` disables clipping.
        stochastic_rounding: round updated bf16 weights stochastically (fp32 weights
            are written exactly).
        seed: seed of the stochastic rounding (per tensor and step, see
            :mod:`neutrain.optim.rounding`).
        gradient_accumulation_steps: micro-batches per optimizer step. With 1
            (the point of fused updates) every gradient is applied and freed at
            once. With ``k > 1`` the gradients of the first ``k - 1`` micro-batches
            are summed into one fp32 buffer per trainable tensor (4 bytes per
            parameter: twice the bf16 weights, allocated only then) and the update
            runs in the ``k``-th backward with the summed gradient, so the result
            equals ordinary accumulation. Micro-batches must go through
            :meth:`backward`; the loss scaling over micro-batches is the caller's.
            A ``step()`` after fewer micro-batches (an epoch's short last window)
            applies the sums accumulated so far.
        chunk_numel: elements per row chunk of an update (bounds fp32 temporaries).
        allow_streaming: let the chunked lm_head loss update its (untied, compressed)
            weight from gradient rows recomputed on demand, instead of building the
            full gradient (saves a vocab x hidden bf16 tensor, 1 GiB on Llama-3-8B,
            for two extra lm_head matrix products); element-wise rules only.
    """

    elementwise = False
    """True for rules whose update of a row depends only on that row (allows streamed updates)."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        *,
        clip_mode: ClipMode | str | None = None,
        max_grad_norm: float | None = None,
        stochastic_rounding: bool = True,
        seed: int = 0,
        gradient_accumulation_steps: int = 1,
        chunk_numel: int = 1 << 24,
        allow_streaming: bool = True,
    ):
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype == torch.float16:
                    raise ValueError(
                        "fp16 parameters are not supported by fused updates: fp16 needs a dynamic loss "
                        "scaler and a second backward to detect overflow before any weight changes. "
                        "Train in bf16 (fp16=False, bf16=True)."
                    )
        self.clip_mode = ClipMode.parse(clip_mode, max_grad_norm)
        self.max_grad_norm = float(max_grad_norm) if self.clip_mode is not ClipMode.NONE else None
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.chunk_numel = int(chunk_numel)
        self.allow_streaming = bool(allow_streaming)
        self._generators = SeededGenerators(self.seed)
        self._hooks: list = []
        self._names: dict[torch.Tensor, str] = {}
        self._tied: set[torch.Tensor] = set()
        self._tied_pending: dict[torch.Tensor, list] = {}
        self._callback_queued = False
        self._in_norm_pass = False
        self.gradient_accumulation_steps = int(gradient_accumulation_steps)
        self._micro_batches = 0  # backward passes since the last step()
        self._accumulating = False
        self._inside_backward = False
        self._grad_sums: dict[torch.Tensor, list] = {}  # key -> [fp32 sum, weight io]
        self._norm_pass_sumsq: dict[torch.device, torch.Tensor] = {}
        self._exact_coef: torch.Tensor | None = None
        self._step_sumsq: dict[torch.device, torch.Tensor] = {}
        self._step_flags: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._prev_grad_norm: torch.Tensor | None = None
        self.steps_done = 0
        self.streamed_updates = 0  # updates applied from recomputed gradient rows (no full gradient)
        self.nonfinite_skips = 0
        self.last_grad_norm: torch.Tensor | None = None
        self.last_skipped: list[str] = []
        # Distributed hooks (neutrain.distributed): an all-reduce of every gradient before its
        # update (replicated data parallel), and per-parameter process groups over which a
        # sharded (FSDP2) tensor's whole-tensor statistics are summed.
        self.grad_sync = None
        # ZeRO-3: the queue of asynchronous reduce-scatters (neutrain.distributed.deepspeed); and the group
        # over which this step's squared norms are still partial (summed once, in step()).
        self.partition_sync = None
        self._partial_norm_group = self._common_shard_group = None
        self._shard_groups: dict[torch.Tensor, object] = {}
        self._updating_key: torch.Tensor | None = None
        self._reindex()

    # ------------------------------------------------------------------ wiring

    def _reindex(self) -> None:
        self._group_of: dict[torch.Tensor, dict] = {}
        self._index_of: dict[torch.Tensor, int] = {}
        for group in self.param_groups:
            for p in group["params"]:
                self._index_of[p] = len(self._index_of)
                self._group_of[p] = group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_group_of"):
            self._reindex()

    def bind(self, model: torch.nn.Module) -> "FusedOptimizer":
        """Connect the optimizer to ``model``'s backward.

        Registers a post-accumulate-grad hook on every dense trainable parameter
        of the param groups and hands the optimizer to every module that exposes
        ``bind_fused_optimizer`` (compressed modules). A compressed weight used by
        two modules (tied embedding and lm_head) is marked tied: its gradient
        contributions are summed and applied once, at the end of backward.

        Returns ``self``. Call again after the model's parameters were replaced
        (e.g. by a distributed wrapper); :meth:`unbind` removes the hooks.
        """
        self.unbind()
        self._names = {p: n for n, p in model.named_parameters(remove_duplicate=False)}
        users: dict[torch.Tensor, int] = {}
        for module in model.modules():
            if hasattr(module, "bind_fused_optimizer"):
                for key in module.bind_fused_optimizer(self):
                    users[key] = users.get(key, 0) + 1
        self._tied = {key for key, count in users.items() if count > 1}
        from neutrain.distributed.shards import shard_groups  # lazy: torch.distributed only when used

        self._shard_groups = shard_groups(self._group_of)
        # Norms may stay partial until step() only if every tensor is a shard over one and the same group
        # (a whole tensor's norm would be counted once per rank).
        groups = set(self._shard_groups.values())
        self._common_shard_group = groups.pop() if len(groups) == 1 and len(self._shard_groups) == len(self._group_of) else None
        for p in self._group_of:
            if p.requires_grad and not getattr(p, COMPRESSED_KEY_ATTR, False):
                self._hooks.append(p.register_post_accumulate_grad_hook(self._dense_hook))
        return self

    def unbind(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _dense_hook(self, param: torch.Tensor) -> None:
        grad, param.grad = param.grad, None
        if grad is not None:
            with torch.no_grad():
                if param in self._shard_groups:  # FSDP2 / ZeRO-3: update this rank's shard
                    from neutrain.distributed.shards import local_shard, submit_local_shard

                    group = self._shard_groups[param]
                    if not submit_local_shard(self.partition_sync, param, grad, group,
                                              lambda g, io: self.consume_grad_(param, g, io)):
                        self.consume_grad_(param, *local_shard(param, grad, group))
                else:
                    self.consume_grad_(param, grad, DenseWeightIO(param))

    # ------------------------------------------------------------ gradients in

    def consume_grad_(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO) -> None:
        """Take one gradient of the weight behind ``key`` and act on it now.

        Called by the dense hooks and by compressed modules' backward. In a norm
        pass it only adds ``||grad||^2`` to the pass total; for a tied weight it
        sums the contribution and defers the update to the end of backward;
        otherwise (or when called outside backward) it reads the weight, updates
        it and writes it back.

        Args:
            key: the parameter in ``param_groups`` that stands for the weight.
            grad: the gradient (any float dtype, same shape as the weight).
            io: access to the weight's storage.
        """
        if key not in self._group_of:
            raise KeyError("gradient for a parameter that is not in this optimizer's param_groups")
        if key in self._tied and in_backward():
            pending = self._tied_pending.get(key)
            if pending is None:
                self._tied_pending[key] = [grad, io]
            else:
                pending[0] = pending[0] + grad
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_tied)
            return
        self._consume_now(key, grad, io)

    def _flush_tied(self) -> None:
        self._callback_queued = False
        pending, self._tied_pending = self._tied_pending, {}
        with torch.no_grad():
            for key, (grad, io) in pending.items():
                self._consume_now(key, grad, io)
            if self.grad_sync is not None:
                self.grad_sync.drain()

    def _consume_now(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO) -> None:
        if self.gradient_accumulation_steps > 1 and not self._inside_backward:
            raise RuntimeError(
                "with gradient_accumulation_steps > 1, run every micro-batch through optimizer.backward(loss) "
                "(a bare loss.backward() cannot tell an early micro-batch from the last)"
            )
        if self._accumulating:  # an early micro-batch: sum, update later
            if self._in_norm_pass:
                return
            pending = self._grad_sums.get(key)
            if pending is None:
                self._grad_sums[key] = [grad.to(torch.float32, copy=True), io]
            else:
                pending[0].add_(grad)
            return
        pending = self._grad_sums.get(key)
        if pending is not None:
            grad = pending[0] + grad
            if not self._in_norm_pass:
                del self._grad_sums[key]
        self._apply(key, grad, io)

    def _apply(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO) -> None:
        if self.grad_sync is not None:
            # Replicated data parallel: average the gradient over the replicas first (asynchronously;
            # the update runs when the all-reduce completes), so norms, clipping and the rule see it.
            self.grad_sync.submit(grad, lambda reduced: self._apply_reduced(key, reduced, io))
        else:
            self._apply_reduced(key, grad, io)

    def _apply_reduced(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO) -> None:
        sumsq = squared_norm(grad, self._chunk_rows(grad))
        if self._norm_can_stay_partial(key):
            # One collective per tensor would stall backward behind every reduce-scatter in flight;
            # the update does not need the whole tensor's norm, so step() sums the partial norms once.
            self._partial_norm_group = self._common_shard_group
        else:
            sumsq = self.shard_sum_(key, sumsq)
        ok = self._account(key, sumsq)
        if ok is None:
            return
        weight = io.read()
        self.update_(key, weight, grad, _ok=ok, _sumsq=sumsq)
        io.write_(weight)

    def _norm_can_stay_partial(self, key: torch.Tensor) -> bool:
        """True for a shard whose update needs no whole-tensor statistic (element-wise rule, no per-tensor clip)."""
        if self._common_shard_group is None or not self.elementwise or self._in_norm_pass:
            return False
        mode = self.clip_mode
        return mode is ClipMode.NONE or (mode is ClipMode.GLOBAL_STALE and self._prev_grad_norm is not None)

    def _account(self, key: torch.Tensor, sumsq: torch.Tensor) -> torch.Tensor | None:
        """Record a gradient's squared norm; returns its finiteness flag, or None in a norm pass (no update)."""
        if self._in_norm_pass:
            _add_on_device(self._norm_pass_sumsq, sumsq)
            return None
        ok = torch.isfinite(sumsq)
        _add_on_device(self._step_sumsq, torch.where(ok, sumsq, torch.zeros_like(sumsq)))
        self._step_flags.append((key, ok))
        return ok

    def _clip_coef(self, sumsq: torch.Tensor) -> torch.Tensor | None:
        mode = self.clip_mode
        if mode is ClipMode.NONE:
            return None
        if mode is ClipMode.GLOBAL_EXACT:
            if self._exact_coef is None:
                raise RuntimeError(
                    "clip_mode='global_exact' needs the two-pass backward: call optimizer.backward(loss), "
                    "or run loss.backward(retain_graph=True) inside `with optimizer.norm_pass():` first."
                )
            return self._exact_coef.to(sumsq.device)
        if mode is ClipMode.GLOBAL_STALE and self._prev_grad_norm is not None:
            return clip_coefficient(self._prev_grad_norm, self.max_grad_norm).to(sumsq.device)
        # per_tensor, and the first step of global_stale (no previous norm yet)
        return clip_coefficient(sumsq.sqrt(), self.max_grad_norm)

    # ----------------------------------------------------------------- update

    @torch.no_grad()
    def update_(
        self,
        key: torch.Tensor,
        weight: torch.Tensor,
        grad: torch.Tensor,
        *,
        _ok: torch.Tensor | None = None,
        _sumsq: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply this optimizer's rule to ``weight`` in place and return it.

        The arithmetic is fp32; a bf16 weight is written back with stochastic
        rounding (if enabled), an fp32 weight exactly. A non-finite gradient
        leaves the weight and the optimizer state untouched, and no element of
        the weight ever becomes non-finite. Clipping follows ``clip_mode``.

        Args:
            key: the parameter in ``param_groups`` standing for the weight (its
                group's ``lr``/``weight_decay`` are read now; state lives in
                ``self.state[key]``).
            weight: contiguous tensor holding the current weight (bf16 or fp32).
            grad: gradient of the same shape.

        Returns:
            ``weight``, updated.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2, 2))
            >>> from neutrain.optim import LOMO
            >>> opt = LOMO([w], lr=0.5)
            >>> opt.update_(w, w.data, torch.ones(2, 2)).tolist()
            [[0.5, 0.5], [0.5, 0.5]]
        """
        if not weight.is_contiguous():
            raise ValueError("fused updates need a contiguous weight tensor")
        if grad.shape != weight.shape:
            raise ValueError(f"gradient shape {tuple(grad.shape)} != weight shape {tuple(weight.shape)}")
        sumsq = squared_norm(grad, self._chunk_rows(grad)) if _sumsq is None else _sumsq
        ok = torch.isfinite(sumsq) if _ok is None else _ok
        coef = self._clip_coef(sumsq)
        self._updating_key = key  # rules with whole-tensor statistics sum them over shards (shard_sum_)
        self._update_tensor(weight, grad, self.state[key], self._group_of[key], ok, coef, self._generator(key, weight))
        return weight

    def _generator(self, key: torch.Tensor, weight: torch.Tensor) -> torch.Generator | None:
        if self.stochastic_rounding and weight.dtype == torch.bfloat16:
            return self._generators.for_update(weight.device, self._index_of[key], self.steps_done)
        return None

    # ------------------------------------------------------- streamed updates

    def streamed_chunk_rows(self, key: torch.Tensor, weight_shape: torch.Size) -> int | None:
        """Rows per chunk if ``key`` can be updated from gradient rows recomputed on demand, else None.

        Possible for element-wise rules (LOMO, AdamW) on untied weights without
        accumulation. The caller (the chunked lm_head loss) then never builds the
        full gradient: see :meth:`apply_streamed_`.
        """
        if (not (self.allow_streaming and self.elementwise) or key in self._tied or self.gradient_accumulation_steps > 1
                or self.grad_sync is not None or key in self._shard_groups):  # distributed: the full gradient is reduced
            return None
        row_numel = max(1, math.prod(weight_shape[1:]))
        return max(1, self.chunk_numel // row_numel)

    def apply_streamed_(self, key: torch.Tensor, io: WeightIO, grad_rows, sumsq: torch.Tensor) -> None:
        """Update a weight from gradient row chunks, without a full-size gradient tensor.

        Same result, bit for bit, as :meth:`consume_grad_` with the full gradient,
        provided ``sumsq`` was accumulated as :func:`~neutrain.optim.clipping.squared_norm`
        does over the chunks of :meth:`streamed_chunk_rows` rows (the per-tensor norm,
        clipping and non-finite check need it before any row changes).

        Args:
            key: the parameter standing for the weight.
            io: the weight's storage.
            grad_rows: ``grad_rows(rows: slice) -> Tensor``, the gradient of those rows;
                called once per chunk, in order.
            sumsq: the gradient's squared norm (0-dim fp32).
        """
        ok = self._account(key, sumsq)
        if ok is None:
            return
        weight = io.read()
        coef = self._clip_coef(sumsq)
        state, group = self.state[key], self._group_of[key]
        self._update_rows(weight, grad_rows, state, group, ok, coef, self._generator(key, weight))
        io.write_(weight)
        self.streamed_updates += 1

    def shard_sum_(self, key: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the ranks holding shards of ``key`` (FSDP2); identity for whole tensors.

        Rules call it on every whole-tensor statistic (squared norms, AdaLomo's column
        sums and RMS), so that a sharded update equals the unsharded one.
        """
        group = self._shard_groups.get(key)
        if group is not None:
            torch.distributed.all_reduce(t, group=group)
        return t

    def full_numel(self, key: torch.Tensor, weight: torch.Tensor) -> int:
        """Elements of the whole tensor behind ``key`` (``weight`` may be this rank's shard)."""
        if key not in self._shard_groups:
            return weight.numel()
        from neutrain.distributed.shards import full_numel

        return full_numel(key)

    def _chunk_rows(self, t: torch.Tensor) -> int:
        row_numel = max(1, as_rows(t).shape[1])
        return max(1, self.chunk_numel // row_numel)

    def _row_chunks(self, t: torch.Tensor) -> Iterable[slice]:
        rows, step = as_rows(t).shape[0], self._chunk_rows(t)
        return (slice(start, start + step) for start in range(0, rows, step))

    def _update_tensor(self, weight, grad, state, group, ok, coef, generator) -> None:
        """Default element-wise driver over the rows of a whole gradient."""
        g_rows = as_rows(grad)
        self._update_rows(weight, lambda rows: g_rows[rows], state, group, ok, coef, generator)

    def _update_rows(self, weight, grad_rows, state, group, ok, coef, generator) -> None:
        """Per row chunk: ``_rule_chunk`` on the chunk's gradient, then write back."""
        scalars = self._begin_tensor(weight, state, group, ok)
        w_rows = as_rows(weight)
        for rows in self._row_chunks(weight):
            p32 = w_rows[rows].to(torch.float32, copy=True)
            new32 = self._rule_chunk(p32, grad_rows(rows), coef, state, group, rows, ok, scalars)
            self._write_rows(w_rows[rows], new32, ok, generator)

    def _begin_tensor(self, weight, state, group, ok):
        """Per-tensor prologue (state init, step counters); returns scalars for the chunks."""
        return None

    def _rule_chunk(self, p32, grad, coef, state, group, rows, ok, scalars) -> torch.Tensor:
        """Return the new fp32 values of weight rows ``rows``.

        ``p32`` is a private fp32 copy of the rows (update it in place); ``grad`` the
        raw gradient rows, to be scaled by the clip coefficient ``coef`` (None: 1).
        """
        raise NotImplementedError

    def _write_rows(self, dst: torch.Tensor, new32: torch.Tensor, ok: torch.Tensor, generator) -> None:
        if dst.dtype == torch.bfloat16 and generator is not None:
            new = stochastic_round_to_bf16(new32, generator, saturate=False)
        else:
            new = new32.to(dst.dtype)
        # Keep the old value wherever the gradient was non-finite or the result is not finite
        # (overflow, or rounding that carried into inf): no weight ever becomes non-finite.
        keep_new = torch.isfinite(new).logical_and_(ok)
        torch.where(keep_new, new, dst, out=dst)

    # ------------------------------------------------------- passes and steps

    @contextlib.contextmanager
    def norm_pass(self):
        """First pass of ``global_exact`` clipping: gradients are only measured.

        Inside the context, every gradient is reduced to its squared norm and
        dropped; on exit the global clip coefficient for the next (real) backward
        is computed. Run the loss backward with ``retain_graph=True`` inside.
        """
        self._in_norm_pass = True
        self._norm_pass_sumsq = {}
        try:
            yield self
        finally:
            self._in_norm_pass = False
        total = _sum_devices(self._norm_pass_sumsq)
        self._exact_coef = clip_coefficient(total.sqrt(), self.max_grad_norm or math.inf)

    def backward(self, loss: torch.Tensor) -> None:
        """Run the backward pass(es) this optimizer's clip mode needs; updates happen inside.

        One ``loss.backward()``, or two for ``global_exact`` (the first only
        measures the global norm; with accumulation, only on the last
        micro-batch). Call :meth:`step` after ``gradient_accumulation_steps`` calls.
        """
        k = self.gradient_accumulation_steps
        if self._micro_batches >= k:
            raise RuntimeError(
                f"{self._micro_batches} backward passes since the last optimizer.step(), but "
                f"gradient_accumulation_steps={k}: call step() after every {k} micro-batch(es)"
            )
        self._micro_batches += 1
        self._accumulating = self._micro_batches < k
        self._inside_backward = True
        try:
            if self.clip_mode is ClipMode.GLOBAL_EXACT and not self._accumulating:
                with self.norm_pass():
                    loss.backward(retain_graph=True)
            loss.backward()
        finally:
            self._accumulating = self._inside_backward = False

    @torch.no_grad()
    def step(self, closure=None):
        """End-of-step bookkeeping; the weights were already updated during backward.

        Applies any tied-weight update still pending (and gradients summed over a
        short accumulation window), computes the step's global
        gradient norm (for logging and for ``global_stale`` clipping), counts and
        logs tensors skipped for non-finite gradients. One host sync, only when a
        tensor was updated.
        """
        if self._grad_sums:
            self._apply_short_window()
        for sync in (self.grad_sync, self.partition_sync):
            if sync is not None:
                sync.drain()
        self._micro_batches = 0
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._tied_pending:
            self._flush_tied()
        self.last_skipped = []
        if self._step_flags:
            keys, flags = zip(*self._step_flags)
            flags = torch.stack([f.to(flags[0].device) for f in flags])
            if self._partial_norm_group is not None:
                flags = self._sum_partial_norms(flags)
            flags = flags.cpu().tolist()
            self.last_skipped = [self._names.get(k, f"param#{self._index_of[k]}") for k, f in zip(keys, flags) if not f]
            if self.last_skipped:
                self.nonfinite_skips += len(self.last_skipped)
                logger.warning(
                    "step %d: non-finite gradient, update skipped for %d tensor(s): %s",
                    self.steps_done, len(self.last_skipped), ", ".join(self.last_skipped[:8]),
                )
            self.last_grad_norm = _sum_devices(self._step_sumsq).sqrt()
            self._prev_grad_norm = self.last_grad_norm
        self._step_sumsq, self._step_flags = {}, []
        self._partial_norm_group = None
        self._exact_coef = None
        self.steps_done += 1
        return loss

    def _sum_partial_norms(self, flags: torch.Tensor) -> torch.Tensor:
        """Sum this step's partial squared norms over the shard group (one collective); agree on the flags.

        A tensor counts as skipped when any rank's shard of its gradient was
        non-finite (those ranks left their shard unchanged).
        """
        import torch.distributed as dist

        total = _sum_devices(self._step_sumsq).to(flags.device, torch.float32)
        packed = torch.cat([total.reshape(1), (~flags).to(torch.float32)])
        dist.all_reduce(packed, group=self._partial_norm_group)
        self._step_sumsq = {packed.device: packed[0]}
        return packed[1:] == 0

    def _apply_short_window(self) -> None:
        """Apply gradients summed over fewer micro-batches than ``gradient_accumulation_steps``.

        Hugging Face's loop steps early at the end of an epoch whose batch count
        is not a multiple of the accumulation; the sums are applied here, once.
        """
        pending, self._grad_sums = self._grad_sums, {}
        if self.grad_sync is not None:  # reduce now: the exact norm below needs the averaged sums
            for entry in pending.values():
                entry[0] = self.grad_sync.reduce_now(entry[0])
            sync, self.grad_sync = self.grad_sync, None
            try:
                return self._apply_window(pending)
            finally:
                self.grad_sync = sync
        self._apply_window(pending)

    def _apply_window(self, pending: dict) -> None:
        if self.clip_mode is ClipMode.GLOBAL_EXACT:
            total = {}
            for grad, _ in pending.values():
                _add_on_device(total, squared_norm(grad, self._chunk_rows(grad)))
            self._exact_coef = clip_coefficient(_sum_devices(total).sqrt(), self.max_grad_norm)
        for key, (grad, io) in pending.items():
            self._apply(key, grad, io)

    def grad_norm(self) -> float | None:
        """The last completed step's global gradient norm (pre-clip, over every tensor updated), or None."""
        return None if self.last_grad_norm is None else float(self.last_grad_norm)

    def pending_grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the step in progress (after its backward, before :meth:`step`).

        For trainers that log the norm before calling ``step()`` (Hugging Face's
        ``_clip_grad_norm``); a device tensor, so reading it syncs only if converted.
        """
        return _sum_devices(self._step_sumsq).sqrt()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Safe no-op: fused updates already freed every gradient; stray ``.grad`` are dropped."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Torch's optimizer state plus the fused bookkeeping (step count, last norm)."""
        sd = super().state_dict()
        sd["fused"] = {
            "steps_done": self.steps_done,
            "nonfinite_skips": self.nonfinite_skips,
            "seed": self.seed,
            "prev_grad_norm": None if self._prev_grad_norm is None else float(self._prev_grad_norm),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        fused = state_dict.pop("fused", None)
        super().load_state_dict(state_dict)
        # Torch casts loaded state to each parameter's dtype; fused state is fp32 by design
        # (bf16 second moments underflow), so reload it keeping dtypes, only moving devices.
        params = [p for group in self.param_groups for p in group["params"]]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id)
            if saved is not None:
                self.state[param] = {
                    k: v.to(param.device, copy=True) if torch.is_tensor(v) else copy.deepcopy(v)
                    for k, v in saved.items()
                }
        self._reindex()
        if fused is not None:
            self.steps_done = int(fused["steps_done"])
            self.nonfinite_skips = int(fused["nonfinite_skips"])
            self.seed = int(fused["seed"])
            self._generators = SeededGenerators(self.seed)
            prev = fused["prev_grad_norm"]
            self._prev_grad_norm = None if prev is None else torch.tensor(prev, dtype=torch.float32)


def _scaled(g: torch.Tensor, coef: torch.Tensor | None) -> torch.Tensor:
    """The gradient in fp32, times the clip coefficient (a fresh tensor unless g is fp32 and unclipped)."""
    g32 = g.float()
    return g32 if coef is None else g32 * coef


def _add_on_device(totals: dict, value: torch.Tensor) -> None:
    current = totals.get(value.device)
    totals[value.device] = value.clone() if current is None else current + value


def _sum_devices(totals: dict) -> torch.Tensor:
    if not totals:
        return torch.zeros((), dtype=torch.float32)
    values = list(totals.values())
    total = values[0]
    for v in values[1:]:
        total = total + v.to(total.device)
    return total
