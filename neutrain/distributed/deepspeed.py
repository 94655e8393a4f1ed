"""DeepSpeed ZeRO-3 with fused updates: the engine partitions parameters, neutrain updates them.

For users who already run DeepSpeed (docs/trainer.md §4). Handing a fused optimizer to
DeepSpeed makes it a ZeRO "client optimizer": DeepSpeed then keeps fp32 gradient
partitions for a ``step()`` that must do the work, the opposite of fusion. So,
as LOMO does, the engine is built **without an optimizer**
(:func:`initialize_zero3`): ZeRO-3 only partitions the parameters and gathers them
around each module's forward and backward (``DeepSpeedZeRoOffload``).

The gradient path:

* backward does **not** go through ``engine.backward`` (it needs an optimizer;
  DeepSpeed 0.19's ``loss.backward()`` on the engine's output raises "Direct
  calls to tensor.backward() are not supported"). The forward runs through
  ``engine.module`` (ZeRO-3's gather hooks live on the modules themselves) and
  :func:`backward` calls ``optimizer.backward(loss)``, plain autograd, then
  resets ZeRO-3's parameter coordinator for the next step;
* each parameter's post-accumulate-grad hook (the hook ZeRO-3 itself uses) gets
  the full gradient of this rank's micro-batch; :func:`partition_grad`
  reduce-scatters it (NCCL; all-reduce and slice on gloo) into this rank's
  partition of the averaged gradient, and the fused rule updates the
  partition ``param.ds_tensor`` in place.

Per-tensor squared norms are summed over the partitions, so clipping and the
global norm match one process. The partition is a flat slice that cuts across
rows, so only element-wise rules apply (LOMO, AdamW-in-backward); AdaLomo's
factored statistics need whole rows: use FSDP2, whose shards are row blocks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_zero3_param(p: torch.Tensor) -> bool:
    """True for a parameter partitioned by ZeRO-3 (it carries ``ds_tensor``)."""
    return hasattr(p, "ds_tensor") and hasattr(p, "ds_numel")


class PartitionIO:
    """Weight I/O over this rank's valid slice of a ZeRO-3 partition (updated in place)."""

    def __init__(self, partition: torch.Tensor):
        self.partition = partition

    def read(self) -> torch.Tensor:
        return self.partition

    def write_(self, weight: torch.Tensor) -> None:
        if weight.data_ptr() != self.partition.data_ptr():
            self.partition.copy_(weight)


def _valid_range(p: torch.Tensor, rank: int) -> tuple[int, int]:
    size = p.ds_tensor.numel()
    start = size * rank
    return start, max(0, min(size, p.ds_numel - start))


def _partition_io(p: torch.Tensor, valid: int) -> PartitionIO:
    return PartitionIO(p.ds_tensor.data.view(-1)[:valid])


def _reduce_scatter_buffers(p: torch.Tensor, grad: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, output)`` of a reduce-scatter of ``grad`` into ``p``'s partitions (input padded to world x size)."""
    size = p.ds_tensor.numel()
    flat = grad.reshape(-1)
    padded = flat if flat.numel() == size * world else torch.nn.functional.pad(flat, (0, size * world - flat.numel()))
    return padded.contiguous(), torch.empty(size, dtype=grad.dtype, device=grad.device)


def partition_grad(p: torch.Tensor, grad: torch.Tensor, group=None) -> tuple[torch.Tensor, PartitionIO]:
    """This rank's slice of the gradient averaged over ``group``, and I/O for the matching weight slice.

    Args:
        p: a ZeRO-3 parameter.
        grad: its full gradient from this rank's micro-batch.
        group: the data-parallel group (default: the world).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    start, valid = _valid_range(p, rank)
    if dist.get_backend(group) == "nccl":
        padded, part = _reduce_scatter_buffers(p, grad, world)
        dist.reduce_scatter_tensor(part, padded, op=dist.ReduceOp.SUM, group=group)
        part = part[:valid]
    else:  # gloo has no reduce-scatter of flat tensors
        flat = grad.reshape(-1).contiguous()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        part = flat[start : start + valid]
    return part.div_(world), _partition_io(p, valid)


def check_fused_config(config: dict, optimizer, source: str = "DeepSpeed config") -> None:
    """Refuse a DeepSpeed config (or optimizer) fused updates cannot run under, naming the key.

    Raises:
        UserInputError (a ``ValueError``): ``source`` names where the config came
            from (``train.deepspeed`` for recipes).
    """
    from neutrain.errors import UserInputError

    stage = config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise UserInputError(
            f"{source}: fused optimizers need zero_optimization.stage 3 (parameter partitioning), got {stage}. "
            "Use launch/deepspeed_zero3_fused.json, or FSDP2 (train.distributed: fsdp2)."
        )
    for key in ("optimizer", "scheduler"):
        if key in config:
            raise UserInputError(
                f"{source}: remove the '{key}' section: a fused optimizer updates the partitions inside backward "
                "and a torch scheduler on it (the recipe's lr_scheduler) drives it "
                "(launch/deepspeed_zero3_fused.json has neither)."
            )
    if config.get("fp16", {}).get("enabled") is True:
        raise UserInputError(f"{source}: fp16.enabled is not supported with fused updates (use bf16 or fp32)")
    if optimizer is not None and not optimizer.elementwise:
        raise UserInputError(
            f"train.optimizer: {type(optimizer).__name__} needs whole-row statistics, but ZeRO-3 partitions are flat "
            "slices. Use lomo or adamw-in-backward under DeepSpeed, or train.distributed: fsdp2 for adalomo."
        )


def zero3_config(config: dict, model: torch.nn.Module) -> dict:
    """The config keys fused updates need on top of a user's ZeRO-3 config (merge them in).

    Persistent parameters (small ones, kept whole on every rank) would be read
    from their full copy, not from the partition the update writes: every
    parameter is partitioned. The weights are updated in the dtype they are
    stored in (there is no fp32 master copy), so ``bf16.enabled`` follows the
    model's dtype and DeepSpeed never casts it (fp16 is off).
    """
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    zero = dict(config["zero_optimization"], stage3_param_persistence_threshold=0, model_persistence_threshold=0)
    return {"zero_allow_untested_optimizer": True, "zero_optimization": zero, "fp16": {"enabled": False},
            "bf16": {**config.get("bf16", {}), "enabled": dtype == torch.bfloat16}}


def submit_partition_grad(queue, p: torch.Tensor, grad: torch.Tensor, finish, group=None) -> bool:
    """Start reduce-scattering ``grad`` asynchronously; ``finish(partition_grad, io)`` runs when it is done.

    The asynchronous form of :func:`partition_grad`: backward goes on computing
    the next gradients while this one is on the wire, and ``queue`` (a
    :class:`~neutrain.distributed.data_parallel.GradientAllReduce`) bounds how
    many wait and finishes them in order, at the latest at the end of backward.
    NCCL only (gloo has no reduce-scatter of flat tensors): returns False, and
    does nothing, for other backends.
    """
    if dist.get_backend(group) != "nccl":
        return False
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _, valid = _valid_range(p, rank)
    padded, part = _reduce_scatter_buffers(p, grad, world)
    work = dist.reduce_scatter_tensor(part, padded, op=dist.ReduceOp.SUM, group=group, async_op=True)
    io = _partition_io(p, valid)

    def done(averaged: torch.Tensor, _keep=padded) -> None:  # _keep: the input lives until the collective ends
        finish(averaged[:valid], io)

    queue.enqueue(work, part, done)
    return True


def initialize_zero3(model: torch.nn.Module, optimizer, config: dict, max_inflight: int = 2):
    """Build a ZeRO-3 engine without an optimizer and bind ``optimizer`` to its partitions.

    Args:
        model: the model (parameters are partitioned in place).
        optimizer: a fused optimizer over ``model.parameters()`` with an element-wise rule.
        config: a DeepSpeed config dict with ``zero_optimization.stage == 3``; no
            ``optimizer``/``scheduler`` sections (the fused optimizer and any torch
            scheduler on it take their place).
        max_inflight: gradients whose reduce-scatter may be in flight while backward
            goes on (NCCL); 0 reduces each one before backward continues.

    Returns:
        The DeepSpeed engine. Run ``loss = engine.module(**batch).loss`` and
        :func:`backward`, then ``optimizer.step()``.

    Example:
        >>> # needs DeepSpeed and a process group (deepspeed / accelerate launch), so not run here:
        >>> opt = build_fused_optimizer(model, "lomo", lr=1e-4, sharding=PARAMETER_SHARDS)  # doctest: +SKIP
        >>> engine = initialize_zero3(model, opt, {"train_micro_batch_size_per_gpu": 1,  # doctest: +SKIP
        ...                                         "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
        >>> backward(engine, opt, engine.module(input_ids=ids, labels=ids).loss); opt.step()  # doctest: +SKIP
    """
    import deepspeed

    check_fused_config(config, optimizer)
    if not isinstance(config.get("train_micro_batch_size_per_gpu"), int):
        raise ValueError("set train_micro_batch_size_per_gpu to an integer (the Trainer fills 'auto'; a user loop must)")
    # 'auto' batch keys (the shipped config is the Trainer's): DeepSpeed derives them from the micro-batch.
    config = {k: v for k, v in config.items() if v != "auto"}
    engine, *_ = deepspeed.initialize(model=model, config={**config, **zero3_config(config, model)})
    bind_partitions(optimizer, engine, max_inflight)
    return engine


def bind_partitions(optimizer, engine, max_inflight: int = 2) -> None:
    """Re-index and re-bind a fused optimizer to a ZeRO-3 engine's partitioned parameters.

    ``max_inflight`` reduce-scatters may be in flight at once (NCCL; 0: each
    gradient is reduced before backward goes on).
    """
    from neutrain.distributed.data_parallel import GradientAllReduce

    optimizer._reindex()
    optimizer.bind(engine.module)
    if not optimizer.shards:
        raise RuntimeError("no ZeRO-3 partitioned parameter found after deepspeed.initialize (build the optimizer "
                           "with sharding=neutrain.distributed.shards.PARAMETER_SHARDS)")
    optimizer.partition_sync = GradientAllReduce(max_inflight=max_inflight) if max_inflight > 0 else None


def backward(engine, optimizer, loss: torch.Tensor) -> None:
    """Backward with fused updates on ZeRO-3 partitions (the forward ran through ``engine.module``)."""
    optimizer.backward(loss)
    offload = engine.optimizer  # DeepSpeedZeRoOffload: partitioning only
    offload.get_param_coordinator().reset_step()
    # Parameters still gathered after backward (the embedding, prefetched ones) hold pre-update copies:
    # release them so that the next forward gathers the updated partitions.
    offload.empty_partition_cache()
