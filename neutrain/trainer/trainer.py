"""``NeuTrainer``: the ``transformers.Trainer`` subclass users run and subclass.

It works with standard ``TrainingArguments`` and adds what neutrain users expect
from every run:

* per-step logs of loss, learning rate, tokens/s and peak memory (GPU allocated
  and reserved, or process RSS on the CPU), through the normal ``Trainer.log``
  path, so ``report_to="tensorboard"`` records them too;
* ``metrics.jsonl`` and a loss/memory PNG in ``output_dir``;
* atomic checkpoints: ``checkpoint-N`` is written to a temporary directory and
  renamed into place, so a run killed while saving leaves the previous
  checkpoint intact, and ``resume_from_checkpoint`` continues exactly.

Example:
    >>> from transformers import TrainingArguments
    >>> from neutrain import NeuTrainer
    >>> class MyTrainer(NeuTrainer):
    ...     def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    ...         return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
    >>> import tempfile, torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                      num_attention_heads=4, num_key_value_heads=2))
    >>> ds = [{"input_ids": torch.arange(16) % 64, "labels": torch.arange(16) % 64}] * 4
    >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, per_device_train_batch_size=2, use_cpu=True,
    ...                          report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    >>> trainer = MyTrainer(model=model, args=args, train_dataset=ds)
    >>> trainer.train().global_step  # doctest: +ELLIPSIS
    step 1/2  loss ...
    step 2/2  loss ...
    step 2/2  training done in ...
    2
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Mapping
from typing import Any

import torch

from neutrain.compat.deepspeed_env import name_cpu_accelerator

# Before transformers' Trainer can import DeepSpeed: on a machine without a GPU, DeepSpeed's accelerator
# detection printed a warning into every script that used NeuTrainer from Python (the CLI names it itself).
name_cpu_accelerator()

from transformers import PrinterCallback, ProgressCallback, Trainer  # noqa: E402

from neutrain import compat
from neutrain.compat.quiet import progress_bars_wanted
from neutrain.compat.trainer_hooks import checkpoint_dir_redirected
from neutrain.config.schema import FUSED_OPTIMIZERS, MemorySection, TrainSection
from neutrain.config.validate import section_from
from neutrain.trainer.callbacks import ChecksummedCheckpoint, MetricsFileCallback, NoFinalSave, PlotCallback
from neutrain.trainer.determinism import deterministic_kernels
from neutrain.memory import Placement, phase
from neutrain.trainer.progress import LabelledProgressCallback, mark_skipped_window
from neutrain.trainer.resume_check import write_run_record
from neutrain.trainer.run_files import host_memory_stats, peak_memory_stats, training_args_as_json
from neutrain.distributed.modes import DistributedMode, Ordinary, choose_mode
from neutrain.distributed.resume import verify_resume
from neutrain.distributed.shards import PARAMETER_SHARDS
from neutrain.nn import DECODE_BUFFERS, CompressedLinear, causal_lm_loss
from neutrain.nn.checkpoint import is_compressed, save_compressed_checkpoint
from neutrain.nn.lora import adapter_state_dict, is_peft_model
from neutrain.nn.activation_file import ActivationFile
from neutrain.nn.chunked_mlp import chunk_mlps
from neutrain.nn.offload import offload_checkpointed_inputs
from neutrain.nn.weight_offload_model import offload_weights, weight_store
from neutrain.optim.factory import build_fused_optimizer
from neutrain.optim.nonfinite import NONFINITE_KEY, watch
from neutrain.optim.registry import optimizer_spec
from neutrain.storage.durable import fsync_dir, fsync_tree
from neutrain.storage.leftovers import mark_writer
from neutrain.storage.run_dir import claim, held, rotate_owned
from neutrain.storage.run_dir import verify as verify_run
from neutrain.storage.run_lock import refuse_linked_checkpoints
from neutrain.storage.manifest import write_manifest
from neutrain.errors import CheckpointError, UserInputError

logger = logging.getLogger("neutrain")
TMP_PREFIX = ".tmp-"
# Train keys NeuTrainer reads, which ``memory=`` also accepts (the form it took before it took ``train=``).
_TRAIN_KEYS_IN_MEMORY = ("optimizer", "max_consecutive_nonfinite")


def _trainer_sections(memory: Mapping[str, Any] | None, train: Mapping[str, Any] | None) -> tuple[MemorySection, TrainSection]:
    """NeuTrainer's ``memory`` and ``train`` arguments as typed sections (schema defaults for missing keys)."""
    if memory is not None and not isinstance(memory, MemorySection):
        moved = {k: memory[k] for k in _TRAIN_KEYS_IN_MEMORY if k in memory}
        if moved:
            train = {**(train or {}), **moved}
            memory = {k: v for k, v in memory.items() if k not in moved}
    return section_from("memory", memory), section_from("train", train)


def _compressed_weights_name(memory: MemorySection) -> str:
    """What a compressed model's checkpoint records as its weights (``neutrain_weights.json``).

    ``memory.weights`` as the recipe says; its schema default ``dense`` cannot describe a compressed
    model, which then holds lossless weights: lossy ones are frozen bases, trained only under an
    adapter and saved as adapters. (NeuTrainer used without a recipe, on a model compressed by hand.)
    """
    return "neuzip-lossless" if memory.weights in ("dense", "auto") else memory.weights


def _unwrap(model):
    return getattr(model, "module", model)


def _output_head(model):
    return _unwrap(model).get_output_embeddings() if hasattr(_unwrap(model), "get_output_embeddings") else None


def _has_compressed_head(model) -> bool:
    return isinstance(_output_head(model), CompressedLinear)


def _has_output_head(model) -> bool:
    """A causal LM head the chunked loss can run (``nn.Linear``, compressed or dense)."""
    return isinstance(_output_head(model), (torch.nn.Linear, CompressedLinear))


class NeuTrainer(Trainer):
    """A ``transformers.Trainer`` with neutrain's logging, plots and atomic checkpoints.

    Fused updates: with ``train={"optimizer": "lomo" | "adalomo" | "adamw-in-backward"}`` (or any optimizer
    registered in :mod:`neutrain.optim.registry`) each weight is updated inside backward, compressed weights
    included; the optimizer's ``step()`` is bookkeeping only, ``max_grad_norm`` clips per the ``clip_mode``, and the
    logged ``grad_norm`` is the real global norm the optimizer measured.

    Args:
        *args: As for ``transformers.Trainer``.
        memory: the recipe's ``memory`` section (a :class:`~neutrain.config.MemorySection`, or a mapping of
            some of its keys: the schema's defaults fill in the rest). It may also carry ``optimizer`` and
            ``max_consecutive_nonfinite``, the train keys below.
        train: the recipe's ``train`` section, or a mapping of some of its keys; NeuTrainer reads ``optimizer``
            (a fused one updates inside backward) and ``max_consecutive_nonfinite`` (see
            :mod:`neutrain.optim.nonfinite`); ``TrainingArguments`` carry the rest. Both ``None``: dense
            weights and the ordinary optimizer step.
        resume_reset_optimizer: resume weights and step only; the optimizer state and learning-rate
            schedule start afresh (``train.resume_reset_optimizer``). Otherwise a checkpoint without them
            is refused.
        **kwargs: As for ``transformers.Trainer``.
    """

    progress_label = "training"
    """What the training progress bar is called (the distillation trainer says "distilling the draft")."""
    loss_names = ("loss", "held-out loss")
    """What the log lines call the training and the held-out loss (the distillation trainer names its divergence)."""

    # compute_loss returns the mean over the micro-batch's tokens (num_items_in_batch aware).
    loss_is_scaled_for_ga = None
    # What differs per engine (neutrain.distributed.modes), chosen from the launch in __init__; the Trainer's own
    # path until then (Trainer.__init__ runs first).
    distributed_mode: DistributedMode = Ordinary()
    # What each checkpoint records of the recipe and model (neutrain.trainer.resume_check.run_record); set by
    # the run that builds the trainer, None (nothing recorded) for a NeuTrainer used on its own.
    run_record: dict[str, Any] | None = None

    def __init__(self, *args, memory: Mapping[str, Any] | None = None, train: Mapping[str, Any] | None = None,
                 resume_reset_optimizer: bool = False, placement: Placement | None = None, **kwargs):
        self.memory, self.train_section = _trainer_sections(memory, train)
        # The memory fit's decision (neutrain.memory.Placement); None: the memory section's keys as they are.
        self.placement = placement
        # Layer inputs spilled to a file (the placement's activation_file_layers): made when training is prepared.
        self.activation_file: ActivationFile | None = None
        self.resume_reset_optimizer = resume_reset_optimizer
        self.fused = self.train_section.optimizer in FUSED_OPTIMIZERS
        super().__init__(*args, **kwargs)
        if self.fused:
            if self.args.fp16:
                raise UserInputError("train: fp16 is not supported with fused updates (they need bf16 or fp32 weights)")
            # The fused optimizer clips inside backward; Hugging Face's clip after backward would see no gradients.
            self._fused_max_grad_norm, self.args.max_grad_norm = self.args.max_grad_norm, 0.0
            if compat.use_one_gpu_per_process(self.args):
                # nn.DataParallel would replicate the model per forward and hand back one loss per GPU;
                # fused updates need one process per GPU instead.
                logger.warning("fused updates train on one GPU per process; this process uses cuda:0 only. "
                               "For all GPUs: accelerate launch --num_processes %d -m neutrain <recipe>",
                               torch.cuda.device_count())
        self.distributed_mode = choose_mode(self.accelerator, self.fused)
        self.distributed_mode.setup(self)
        self._bound_after_prepare = not self.distributed_mode.sharded  # FSDP2/ZeRO-3 replace parameters in prepare
        if self.args.dataloader_pin_memory and not torch.cuda.is_available():
            self.args.dataloader_pin_memory = False  # nothing to pin for; torch warned on every data loader
        # Log a NaN loss as NaN: Hugging Face's filter logs the previous average instead (0.0 on a first step).
        self.args.logging_nan_inf_filter = False
        self._nonfinite = None  # the optimizer's NonFiniteMonitor (neutrain.optim.nonfinite), once it exists
        self._tokens_since_log = 0
        self._last_log_time: float | None = None
        self.add_callback(ChecksummedCheckpoint())  # a checkpoint's trainer_state.json says it has a manifest
        self.add_callback(MetricsFileCallback())
        self.add_callback(PlotCallback(self.loss_names))
        if not self.train_section.save_final:
            self.add_callback(NoFinalSave())
        # Labelled bars and readable log lines instead of transformers' (neutrain.trainer.progress).
        self.remove_callback(ProgressCallback)
        self.remove_callback(PrinterCallback)
        # Bars only on a terminal: in a log file or pipe every redraw stays, carriage returns and all.
        self.add_callback(LabelledProgressCallback(self.progress_label, bars=not self.args.disable_tqdm and progress_bars_wanted(),
                                                   names=self.loss_names))

    # ---- fused updates and compressed weights ---------------------------------------------

    def create_optimizer(self, model=None):
        if not self.fused:
            opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
            if not self.is_deepspeed_enabled:  # DeepSpeed steps its client optimizer per partition group
                self._watch_nonfinite(opt)
            return opt
        if self.optimizer is None:
            options = dict(
                clip_mode=self.memory.clip_mode, max_grad_norm=self._fused_max_grad_norm or None,
                stochastic_rounding=self.memory.stochastic_rounding, seed=self.args.seed,
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
            )
            options.update(optimizer_spec(self.train_section.optimizer).options(self.args))  # betas, eps, ...
            if self.distributed_mode.sharded:  # each rank updates its shards (optim.sharding)
                options.update(sharding=PARAMETER_SHARDS)
            # Matrices get weight decay, norms and biases none (as the Trainer does for AdamW).
            self.optimizer = build_fused_optimizer(self.model if model is None else model, self.train_section.optimizer,
                                                   lr=self.args.learning_rate, weight_decay=self.args.weight_decay, **options)
            self.distributed_mode.attach(self.optimizer, _unwrap(self.model if model is None else model))
        self._watch_nonfinite(self.optimizer)
        return self.optimizer

    def _watch_nonfinite(self, optimizer) -> None:
        """Skip, log and count non-finite steps; stop after too many in a row (neutrain.optim.nonfinite)."""
        self._nonfinite = watch(optimizer, self.train_section.max_consecutive_nonfinite, lambda: self.state.global_step + 1)

    @property
    def nonfinite_skipped_steps(self) -> int:
        """Optimizer steps skipped for a non-finite loss or gradient over the whole run (resumes included)."""
        if self._nonfinite is None:  # no optimizer built (the phases after training of a relaunched run): as logged
            return max((int(h[NONFINITE_KEY]) for h in self.state.log_history if NONFINITE_KEY in h), default=0)
        return self._nonfinite.total(self.state.log_history)

    def _bind_after_prepare(self, model) -> None:
        """FSDP2/DeepSpeed replace parameters in ``accelerator.prepare``: hook the fused update to the new ones."""
        self.distributed_mode.bind_after_prepare(self.fused_optimizer, _unwrap(model))
        self._bound_after_prepare = True

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        prepared = self.distributed_mode.prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint,
                                                              super()._prepare_for_training)
        planned = self.placement
        store = weight_store(_unwrap(self.model))
        offload = planned.offload_weights if planned is not None else self.memory.offload_weights
        asked = len(planned.streamed) if planned is not None and planned.streamed else self.memory.offload_layers
        activations = planned.offload_activations if planned is not None else self.memory.offload_activations
        if offload and store is None:
            # A model built elsewhere: its layers (memory.offload_layers of them) go to host memory now.
            offload_weights(_unwrap(self.model), count=asked, slots=self.memory.offload_slots)
        elif store is not None and asked is not None and len(store.layers) != asked:
            # The planner counted `asked` layers' worth of device memory and PCIe bytes; say where they differ.
            logger.warning("memory.offload_layers: %d asked, but the build put %d decoder layers in host memory",
                           asked, len(store.layers))
        chunk = self.memory.mlp_chunk_tokens
        if chunk != "auto" and chunk > 0 and self.distributed_mode.sharded:
            # Sharded parameters are gathered by each module's own forward, which the chunked MLP bypasses.
            logger.warning("memory.mlp_chunk_tokens: %d ignored: parameters are sharded (FSDP2/ZeRO-3)", chunk)
        elif chunk != "auto" and chunk > 0:  # auto the fit left as it was: unchunked
            mlps = chunk_mlps(_unwrap(self.model), chunk)
            logger.info("memory.mlp_chunk_tokens: %d gated MLPs compute %d tokens at a time", mlps, chunk)
            if not mlps:
                logger.warning("memory.mlp_chunk_tokens: no MLP of this model can be chunked (an adapter, a bias or "
                               "experts): each runs whole, beyond the planned memory")
        if activations:
            # Trainer.train enabled checkpointing before this point; wrap each layer's checkpoint now.
            on_device, in_file = ((planned.activation_device_layers, planned.activation_file_layers)
                                  if planned is not None else (0, 0))
            if in_file and self.activation_file is None:  # the host is short (neutrain.memory.tiers)
                self.activation_file = ActivationFile(os.path.join(self.args.output_dir, ".cache"))
            layers = offload_checkpointed_inputs(_unwrap(self.model), on_device, in_file, self.activation_file)
            if on_device or in_file:
                logger.info("memory.offload_activations: of %d checkpointed layers' inputs, %d stay on the GPU, %d "
                            "wait in host memory and %d in a file under %s (the host cannot hold them all)",
                            layers, on_device, layers - on_device - in_file, in_file, self.activation_file.folder
                            if self.activation_file else "-")
            else:
                logger.info("memory.offload_activations: %d checkpointed layers keep their inputs in host memory", layers)
        return prepared

    def host_memory(self) -> dict[str, float]:
        """The run's host memory and PCIe bytes so far (:func:`~neutrain.trainer.run_files.host_memory_stats`)."""
        return host_memory_stats(weight_store(_unwrap(self.model)), self.activation_file)

    @property
    def fused_optimizer(self):
        """The unwrapped fused optimizer (Accelerate wraps it), or None."""
        opt = self.optimizer
        return getattr(opt, "optimizer", opt) if self.fused else None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # A fused training step takes the chunked loss whether the weights are compressed or dense: the
        # model's own loss rounds differently (soft-capped logits: Gemma 3 drifted 1 bf16 ulp per step
        # from its compressed twin), and NeuZip lossless promises dense training's exact model.
        # Not where parameters are sharded (FSDP2, ZeRO-3): the chunked loss reads lm_head.weight directly,
        # which only the head's own forward gathers there.
        fused_training = (self.fused and not self.distributed_mode.sharded and _unwrap(model).training
                          and _has_output_head(model))
        if self.memory.loss_chunk_size <= 0 and not _has_compressed_head(model) and not fused_training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # The chunked lm_head + cross-entropy never materialises the full logits.
        kwargs = {k: v for k, v in inputs.items() if k not in ("input_ids", "labels", "attention_mask")}
        loss = causal_lm_loss(
            _unwrap(model), inputs["input_ids"], inputs["labels"], attention_mask=inputs.get("attention_mask"),
            num_items_in_batch=num_items_in_batch, **kwargs,
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and self.accelerator.num_processes > 1:
            # num_items_in_batch counts every process's tokens and gradients are averaged over processes,
            # so scale back up, as Trainer.compute_loss does for models that take loss kwargs.
            loss = loss * self.accelerator.num_processes
        # prediction_step reads logits from the outputs; the chunked loss has none to give.
        return (loss, {"loss": loss}) if return_outputs else loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._count_tokens(inputs)
        if not self.fused:
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self._nonfinite is not None:  # checked with the gradients, in the optimizer step
                self._nonfinite.note_loss(loss)
            return loss
        # Same loss semantics as Trainer.training_step, but backward goes through the fused optimizer
        # (updates happen inside it) rather than accelerator.backward, which has DeepSpeed/GradScaler
        # branches that bypass fused updates.
        model.train()
        if not self._bound_after_prepare:
            self._bind_after_prepare(model)
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(self.distributed_mode.loss_model(model), inputs, num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is None and self.args.gradient_accumulation_steps > 1:
            loss = loss / self.args.gradient_accumulation_steps
        self.distributed_mode.backward(model, self.fused_optimizer, loss)
        return loss.detach()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        return self.distributed_mode.save_state(self, output_dir, super()._save_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint):
        # (DeepSpeed ZeRO-3 loads partitions and optimizer together, in its prepare_for_training.)
        if checkpoint is not None and self.reset_optimizer_on_resume(checkpoint):
            return None
        if checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
        else:
            self.distributed_mode.load_state(self, checkpoint, super()._load_optimizer_and_scheduler)
        if checkpoint is not None and self.lr_scheduler is not None:
            from neutrain.trainer.run_state import resync_learning_rate

            resync_learning_rate(self.lr_scheduler)  # max_steps may have changed since the checkpoint

    def _save(self, output_dir: str | None = None, state_dict=None):
        model = _unwrap(self.model)
        if is_peft_model(model):
            # Adapters only (the frozen base is not saved); skips cloning a compressed base's blobs.
            super()._save(output_dir, adapter_state_dict(model) if state_dict is None else state_dict)
            return training_args_as_json(self.args, output_dir or self.args.output_dir)
        if not is_compressed(model):
            super()._save(output_dir, state_dict)
            return training_args_as_json(self.args, output_dir or self.args.output_dir)
        if not self.args.should_save:
            # transformers calls _save on every process of a replicated run and leaves the guard to it: two CPU
            # processes (torchrun) both wrote model.safetensors and one rename failed ("No such file").
            return
        output_dir = output_dir or self.args.output_dir
        save_compressed_checkpoint(model, output_dir, _compressed_weights_name(self.memory))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        training_args_as_json(self.args, output_dir)

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``Trainer.train``; a checkpoint to resume is verified first (:mod:`neutrain.storage.manifest`), and
        ``train.deterministic`` runs it on reproducible kernels (:mod:`neutrain.trainer.determinism`)."""
        if self.args.should_save:
            refuse_linked_checkpoints(self.args.output_dir)  # refused now, not after the steps before the first save
        if resume_from_checkpoint:
            if resume_from_checkpoint is True:
                from transformers.trainer_utils import get_last_checkpoint

                resume_from_checkpoint = get_last_checkpoint(self.args.output_dir) or True  # None: the Trainer's error
            if resume_from_checkpoint is not True:
                self.distributed_mode.check_resume(resume_from_checkpoint)
                verify_resume(resume_from_checkpoint, self.distributed_mode, self.args.process_index,
                              self.args.world_size, self.resume_reset_optimizer)
        try:
            with deterministic_kernels(self.train_section.deterministic):
                return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            DECODE_BUFFERS.give_back_lent()  # the layer groups' slot: export and generation plan without it
            if self.activation_file is not None:  # its space back to the disk, whether training ended or failed
                self.activation_file.close()  # (opened again by the next write, should this trainer train again)

    def load_trained(self, checkpoint: str) -> None:
        """The weights and training log of ``checkpoint`` (a run's last step), for the phases after training.

        Verified as a resume would be (checksums, no pickle), without the optimizer state: nothing trains.
        """
        from transformers import TrainerState

        self.distributed_mode.check_resume(checkpoint)
        verify_resume(checkpoint, self.distributed_mode, self.args.process_index, self.args.world_size, True)
        self._load_from_checkpoint(checkpoint)
        self.state = TrainerState.load_from_json(os.path.join(checkpoint, "trainer_state.json"))

    def reset_optimizer_on_resume(self, checkpoint: str) -> bool:
        """True (and logged) when ``resume_reset_optimizer`` asks to skip the checkpoint's optimizer and schedule."""
        if self.resume_reset_optimizer:
            logger.warning("train.resume_reset_optimizer: the optimizer state and learning-rate schedule start "
                           "afresh, not from %s", checkpoint)
        return self.resume_reset_optimizer

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        with phase("resume"):
            loaded = self.distributed_mode.load_model(self, resume_from_checkpoint, model, self._load_whole_weights)
            if torch.cuda.is_available():
                # What the load freed and did not reuse (the random init's blobs, the device checksum's
                # chunks) goes back before the first step: a resumed step reserved 1.3 GiB more than the
                # uninterrupted one for the same allocations (Llama-3-8B, benchmarks/cards/NOTES.md).
                torch.cuda.empty_cache()
            return loaded

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate``, measured as the run's ``eval`` phase (:mod:`neutrain.memory.phases`)."""
        with phase("eval"):
            return super().evaluate(*args, **kwargs)

    def _load_whole_weights(self, resume_from_checkpoint, model=None):
        """A checkpoint's whole weights: neutrain's compressed files, else the Trainer's own loading."""
        from neutrain.nn.checkpoint_weights import load_weights

        target = _unwrap(model if model is not None else self.model)
        # Dense or compressed, either way (memory.weights: auto may resolve otherwise on another card); a LoRA
        # checkpoint holds adapters only, which the Trainer loads.
        if is_peft_model(target) or not load_weights(target, resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)

    # ---- logging -------------------------------------------------------------------------

    def _count_tokens(self, inputs) -> None:
        if self._last_log_time is None:
            self._last_log_time = time.perf_counter()
        ids = inputs.get("input_ids")
        if ids is not None:
            mask = inputs.get("attention_mask")
            # A device tensor until the next log: int() here would wait for the GPU every step.
            self._tokens_since_log = self._tokens_since_log + (mask.sum() if mask is not None else ids.numel())

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs:
            now = time.perf_counter()
            if self._last_log_time is not None and now > self._last_log_time:
                # Global throughput: every process sees its own shard of the batch.
                tokens = int(self._tokens_since_log) * self.args.world_size
                logs["tokens_per_second"] = tokens / (now - self._last_log_time)
                # The window's own tokens and seconds: the run's throughput is their sums' ratio, not a mean of
                # window rates (a slow window, a save in it, weighs as much as a fast one in a mean).
                logs["window_tokens"], logs["window_seconds"] = tokens, now - self._last_log_time
            self._tokens_since_log, self._last_log_time = 0, now
            logs.update(peak_memory_stats())
            opt = self.fused_optimizer
            if opt is not None:
                norm = opt.grad_norm()
                if norm is not None:
                    logs["grad_norm"] = norm
                logs["nonfinite_skips"] = opt.nonfinite_skips
            if self._nonfinite is not None:
                logs["nonfinite_skipped_steps"] = self.nonfinite_skipped_steps
                mark_skipped_window(logs, self.state.log_history, self.state.global_step)
            if isinstance(getattr(self, "_tr_loss", None), torch.Tensor):
                # The Trainer resets its running loss by subtracting it from itself, which keeps a NaN for good.
                self._tr_loss.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        super().log(logs, *args, **kwargs)

    # ---- checkpoints ---------------------------------------------------------------------

    def _save_checkpoint(self, model, trial) -> None:
        """Write ``checkpoint-N`` into a temporary directory, then rename it into place.

        Why: ``Trainer`` writes straight into ``checkpoint-N``; a run killed halfway
        leaves a directory that ``get_last_checkpoint`` picks up and cannot resume.
        Rotation of old checkpoints happens only after the rename, and deletes only checkpoints the
        run lists as its own (:mod:`neutrain.storage.run_dir`). A save that fails (a full disk, any
        error) removes its temporary and puts back a checkpoint of the same step it had set aside.
        """
        run_dir = self._get_output_dir(trial=trial)
        name = f"checkpoint-{self.state.global_step}"
        tmp_run_dir = os.path.join(run_dir, f"{TMP_PREFIX}{name}")
        final = os.path.join(run_dir, name)
        old = os.path.join(run_dir, f"{TMP_PREFIX}old-{name}")
        if self.args.should_save:
            refuse_linked_checkpoints(run_dir)  # before anything is written: no temporaries are left behind
            claim(final)  # the run's own, before it exists: rotation and an overwrite delete only these
            if os.path.isdir(tmp_run_dir):
                shutil.rmtree(tmp_run_dir)  # leftovers of a run killed while saving
            mark_writer(tmp_run_dir)  # a start elsewhere leaves it alone while this process lives
        try:
            self._write_checkpoint(model, trial, run_dir, name, tmp_run_dir, final, old)
        except BaseException:
            if self.args.should_save:
                shutil.rmtree(tmp_run_dir, ignore_errors=True)
                if os.path.isdir(old) and not os.path.isdir(final):
                    os.replace(old, final)  # the checkpoint of this step that was being replaced
            raise
        if self.args.world_size > 1:
            self.args.distributed_state.wait_for_everyone()

    def _write_checkpoint(self, model, trial, run_dir: str, name: str, tmp_run_dir: str, final: str, old: str) -> None:
        if self.args.world_size > 1:
            self.args.distributed_state.wait_for_everyone()
        # A state resumed from a checkpoint written before the mark lacks its entry, which the Trainer's save expects.
        self.state.stateful_callbacks.setdefault(ChecksummedCheckpoint.__name__, {})
        with checkpoint_dir_redirected(self, tmp_run_dir), phase("save"):
            super()._save_checkpoint(model, trial)
        if self.args.world_size > 1:
            self.args.distributed_state.wait_for_everyone()
        if not self.args.should_save:
            return
        if self.run_record is not None:  # what a resume compares against its recipe (neutrain.trainer.resume_check)
            write_run_record(os.path.join(tmp_run_dir, name), self.run_record)
        write_manifest(os.path.join(tmp_run_dir, name))  # last: every rank's files are complete
        # On the disk before the rename: after a power cut the renamed checkpoint holds every byte (not
        # zero-length files), and only then may the one it replaces, or rotation, delete anything.
        fsync_tree(os.path.join(tmp_run_dir, name))
        verify_run(run_dir)  # still the directory the run started in
        if os.path.isdir(final):  # re-saving the same step: keep the old one until the new one is in place
            os.replace(final, old)
        os.replace(os.path.join(tmp_run_dir, name), final)
        fsync_dir(run_dir)
        if os.path.isdir(old):
            shutil.rmtree(old)
        shutil.rmtree(tmp_run_dir, ignore_errors=True)
        if self.state.best_model_checkpoint and self.state.best_model_checkpoint.startswith(tmp_run_dir):
            self.state.best_model_checkpoint = final
        found = held(run_dir + os.sep + name)
        if found is not None:
            rotate_owned(found[0], self.args.save_total_limit, keep=(self.state.best_model_checkpoint,))
        else:  # a NeuTrainer used on its own, in a directory no run holds: the Trainer's rotation, as before
            compat.rotate_checkpoints(self, run_dir)
