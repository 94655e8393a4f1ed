"""The fused-update optimizer base: apply each gradient the moment it exists.

LOMO's idea (docs/trainer.md §1, §3, §7): update each weight inside backward and
free its gradient at once, so at most a layer's gradient is alive. Rules
(:class:`~neutrain.optim.LOMO`, :class:`~neutrain.optim.AdaLomo`,
:class:`~neutrain.optim.AdamWInBackward`) write only the per-tensor arithmetic
(:mod:`~neutrain.optim.rule`). :class:`FusedOptimizer` routes each gradient
through its parts: :mod:`~neutrain.optim.hooks` (where gradients come from),
:mod:`~neutrain.optim.accumulation`, :mod:`~neutrain.optim.grad_stats` (norms,
clipping, non-finite skips), :mod:`~neutrain.optim.sharding` (an interface
``distributed`` implements and injects), :mod:`~neutrain.optim.streamed` and
:mod:`~neutrain.optim.state_io`.

It is a real ``torch.optim.Optimizer``: ``param_groups`` hold ``lr`` and
``weight_decay``, read live at every update (schedulers work); ``state`` is keyed
by parameter and survives ``state_dict()``/``load_state_dict()``. ``step()`` does
only end-of-step bookkeeping (norms, counters, non-finite report).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from neutrain.optim import state_io
from neutrain.optim.accumulation import Accumulator
from neutrain.optim.clipping import ClipMode, squared_norm
from neutrain.optim.grad_stats import GradStats
from neutrain.optim.hooks import BackwardHooks
from neutrain.optim.rounding import SeededGenerators
from neutrain.optim.rule import ChunkedRule
from neutrain.optim.sharding import Sharding, ShardMap
from neutrain.optim.streamed import StreamedUpdates
from neutrain.optim.weight_io import COMPRESSED_KEY_ATTR, DenseWeightIO, WeightIO

__all__ = ["COMPRESSED_KEY_ATTR", "DenseWeightIO", "FusedOptimizer", "WeightIO"]


class FusedOptimizer(ChunkedRule, torch.optim.Optimizer):
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
        gradient_accumulation_steps: micro-batches per optimizer step
            (:mod:`neutrain.optim.accumulation`). Micro-batches must go through
            :meth:`backward`; the loss scaling over micro-batches is the caller's.
            A ``step()`` after fewer micro-batches (an epoch's short last window)
            applies the sums accumulated so far.
        chunk_numel: elements per row chunk of an update (bounds fp32 temporaries).
        allow_streaming: let the chunked lm_head loss update its (untied, compressed)
            weight from gradient rows recomputed on demand (:mod:`neutrain.optim.streamed`).
        sharding: the distributed backend's :class:`~neutrain.optim.sharding.Sharding`
            for a run whose parameters are shards (FSDP2, ZeRO-3); None: no shards.

    Example:
        >>> from neutrain.optim import LOMO
        >>> model = torch.nn.Linear(4, 4)
        >>> opt = LOMO(model.parameters(), lr=0.1, gradient_accumulation_steps=2).bind(model)
        >>> for _ in range(2):
        ...     opt.backward(model(torch.ones(1, 4)).sum())  # the update runs in the second
        >>> opt.step(); opt.steps_done, opt.grad_norm() > 0
        (1, True)
    """

    elementwise = False
    """True for rules whose update of a row depends only on that row (allows streamed updates)."""

    keeps_nonfinite_elements = False
    """True for rules whose new value of an element is non-finite wherever its gradient is (and that keep
    no state a non-finite gradient could poison): the write-back then keeps those elements by itself, so
    the update may run before the gradient's finiteness is known (:meth:`updates_before_norm`)."""

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
        sharding: Sharding | None = None,
    ):
        self.accumulation = Accumulator(gradient_accumulation_steps)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype == torch.float16:
                    raise ValueError(
                        "fp16 parameters are not supported by fused updates: fp16 needs a dynamic loss "
                        "scaler and a second backward to detect overflow before any weight changes. "
                        "Train in bf16 (fp16=False, bf16=True)."
                    )
        mode = ClipMode.parse(clip_mode, max_grad_norm)
        self.stats = GradStats(mode, float(max_grad_norm) if mode is not ClipMode.NONE else None)
        self.stochastic_rounding = bool(stochastic_rounding)
        self.seed = int(seed)
        self.chunk_numel = int(chunk_numel)
        self._generators = SeededGenerators(self.seed)
        self.hooks = BackwardHooks(self)
        self.streamed = StreamedUpdates(self, allow_streaming)
        self.shards = ShardMap(sharding)
        self.steps_done = 0
        # Distributed hooks (neutrain.distributed): an all-reduce of every gradient before its update
        # (replicated data parallel), and ZeRO-3's queue of asynchronous reduce-scatters.
        self.grad_sync = None
        self.partition_sync = None
        self._updating_key: torch.Tensor | None = None
        self._writing_io: WeightIO | None = None
        self._reindex()

    # ---- read-only views of the parts, under the names callers always used
    clip_mode = property(lambda self: self.stats.clip_mode)
    max_grad_norm = property(lambda self: self.stats.max_grad_norm)
    last_grad_norm = property(lambda self: self.stats.last_grad_norm)
    last_skipped = property(lambda self: self.stats.last_skipped)
    nonfinite_skips = property(lambda self: self.stats.nonfinite_skips)
    gradient_accumulation_steps = property(lambda self: self.accumulation.steps)
    allow_streaming = property(lambda self: self.streamed.enabled)
    streamed_updates = property(lambda self: self.streamed.count)

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
        """Connect the optimizer to ``model``'s backward (:class:`~neutrain.optim.hooks.BackwardHooks`).

        Registers a post-accumulate-grad hook on every dense trainable parameter
        of the param groups and hands the optimizer to every module that exposes
        ``bind_fused_optimizer`` (compressed modules); finds the parameters that
        are shards (through the injected ``sharding``).

        Returns ``self``. Call again after the model's parameters were replaced
        (e.g. by a distributed wrapper); :meth:`unbind` removes the hooks.
        """
        self.hooks.bind(model, self._group_of, lambda: self.shards.rebuild(self._group_of))
        return self

    def unbind(self) -> None:
        self.hooks.unbind()

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
        if not self.hooks.defer_tied(key, grad, io):
            self._consume_now(key, grad, io)

    def _consume_now(self, key: torch.Tensor, grad: torch.Tensor, io: WeightIO) -> None:
        grad = self.accumulation.take(key, grad, io, self.stats.in_norm_pass)
        if grad is not None:
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
        # An element-wise rule without a per-tensor clip needs no whole-tensor statistic.
        may_defer = self.elementwise and not self.stats.in_norm_pass and not self.stats.needs_tensor_norm()
        sumsq = self.shards.tensor_sumsq(key, sumsq, may_defer)
        ok = self.stats.account(key, sumsq)
        if ok is None:
            return
        if self.updates_before_norm():  # as the single-pass streamed update: element-wise keep
            ok = torch.ones_like(ok)
        weight = io.read()
        with self.writing_to(io):
            self.update_(key, weight, grad, _ok=ok, _sumsq=sumsq)
        io.write_(weight)

    @contextlib.contextmanager
    def writing_to(self, io: WeightIO):
        """While a rule updates the weight behind ``io`` (rules may ask it for ``count_into``)."""
        self._writing_io = io
        try:
            yield
        finally:
            self._writing_io = None

    def count_into(self, weight: torch.Tensor):
        """The weight I/O's re-encode counting target for ``weight`` (:mod:`neutrain.compress.counted`), or None."""
        count_into = getattr(self._writing_io, "count_into", None)
        return count_into(weight) if count_into is not None else None

    def updates_before_norm(self) -> bool:
        """Whether an update may run before its gradient's norm is known (the single-pass streamed update).

        True for a rule that :attr:`keeps_nonfinite_elements` when the clip coefficient does not depend on
        the tensor's own norm (``none``; ``global_stale`` once a previous norm exists), outside a norm pass.
        A non-finite gradient then means *element-wise keep*, on every path alike (whole gradient or
        streamed, so dense and compressed training stay bit-identical): the elements whose gradient is
        non-finite keep their weight, the others are updated, and the tensor is still flagged, counted and
        logged as skipped and left out of the step's norm. Otherwise (``per_tensor``, the first
        ``global_stale`` step, ``global_exact``) the norm comes first and a non-finite gradient keeps the
        whole tensor.
        """
        return self.keeps_nonfinite_elements and not self.stats.in_norm_pass and not self.stats.needs_tensor_norm()

    def streamed_chunk_rows(self, key: torch.Tensor, weight_shape: torch.Size) -> int | None:
        """Rows per chunk of a streamed update of ``key``, or None (:meth:`~neutrain.optim.streamed.StreamedUpdates.chunk_rows`)."""
        return self.streamed.chunk_rows(key, weight_shape)

    def apply_streamed_(self, key: torch.Tensor, io: WeightIO, grad_rows, sumsq) -> None:
        """Update a weight from recomputed gradient row chunks, bit for bit as from the full gradient
        (:meth:`~neutrain.optim.streamed.StreamedUpdates.apply_`; ``sumsq`` a tensor or a callable
        that measures it, called only when the update needs the norm first)."""
        self.streamed.apply_(key, io, grad_rows, sumsq)

    def shard_sum_(self, key: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` in place over the ranks holding shards of ``key``; rules call it on every whole-tensor
        statistic (AdaLomo's column sums and RMS), so that a sharded update equals the unsharded one."""
        return self.shards.sum_(key, t)

    def full_numel(self, key: torch.Tensor, weight: torch.Tensor) -> int:
        """Elements of the whole tensor behind ``key`` (``weight`` may be this rank's shard)."""
        return self.shards.full_numel(key, weight)

    # ------------------------------------------------------- passes and steps

    @contextlib.contextmanager
    def norm_pass(self):
        """First pass of ``global_exact`` clipping: gradients are only measured.

        Inside the context, every gradient is reduced to its squared norm and
        dropped; on exit the global clip coefficient for the next (real) backward
        is computed. Run the loss backward with ``retain_graph=True`` inside.
        """
        with self.stats.norm_pass():
            yield self

    def backward(self, loss: torch.Tensor) -> None:
        """Run the backward pass(es) this optimizer's clip mode needs; updates happen inside.

        One ``loss.backward()``, or two for ``global_exact`` (the first only
        measures the global norm; with accumulation, only on the last
        micro-batch). Call :meth:`step` after ``gradient_accumulation_steps`` calls.
        """
        self.accumulation.begin()
        try:
            if self.clip_mode is ClipMode.GLOBAL_EXACT and not self.accumulation.accumulating:
                with self.norm_pass():
                    loss.backward(retain_graph=True)
            loss.backward()
        finally:
            self.accumulation.end()

    @torch.no_grad()
    def step(self, closure=None):
        """End-of-step bookkeeping; the weights were already updated during backward.

        Applies any tied-weight update still pending (and gradients summed over a
        short accumulation window), computes the step's global
        gradient norm (for logging and for ``global_stale`` clipping), counts and
        logs tensors skipped for non-finite gradients. No host sync: the skip flags
        reach the host asynchronously (:meth:`~neutrain.optim.grad_stats.GradStats.settle`);
        reading :attr:`last_skipped` or :attr:`nonfinite_skips` waits for them.
        """
        if self.accumulation.sums:  # a window that ended early (an epoch's last batches): apply its sums once
            self.accumulation.apply_short_window(self)
        for sync in (self.grad_sync, self.partition_sync):
            if sync is not None:
                sync.drain()
        self.accumulation.reset()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.hooks.pending:
            self.hooks.flush()
        self.stats.finish_step(self.hooks.name_of, self.steps_done, self.shards.partial_group)
        self.shards.partial_group = None
        self.steps_done += 1
        return loss

    def grad_norm(self) -> float | None:
        """The last completed step's global gradient norm (pre-clip, over every tensor updated), or None."""
        return self.stats.grad_norm()

    def pending_grad_norm(self) -> torch.Tensor:
        """The global gradient norm of the step in progress (after its backward, before :meth:`step`).

        For trainers that log the norm before calling ``step()`` (Hugging Face's
        ``_clip_grad_norm``); a device tensor, so reading it syncs only if converted.
        """
        return self.stats.pending_grad_norm()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Safe no-op: fused updates already freed every gradient; stray ``.grad`` are dropped."""
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """Torch's optimizer state plus the fused bookkeeping (step count, last norm)."""
        sd = super().state_dict()
        sd[state_io.FUSED_KEY] = state_io.bookkeeping(self)
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        fused = state_dict.pop(state_io.FUSED_KEY, None)
        super().load_state_dict(state_dict)
        state_io.reload_keeping_dtypes(self, state_dict)
        self._reindex()
        if fused is not None:
            state_io.restore_bookkeeping(self, fused)
