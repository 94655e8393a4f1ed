"""``neutrain export``: write a checkpoint as an inference model directory (dense HF or NeuZip)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from neutrain.cli.checkpoints import last_checkpoint, load_model_checkpoint, run_facts, run_recipe, trained_with_chat_template
from neutrain.cli.ignored import refuse_ignored
from neutrain.config.after_training_sections import export_dtype_refusal
from neutrain.config.numbers import FlagError, SHARD_SIZE, number_argument
from neutrain.config.schema import SCHEMA
from neutrain.config.sections import ModelSection
from neutrain.errors import UserInputError
from neutrain.export.target import check_export_target


def configure(p) -> None:
    """The ``export`` command's description and arguments, on its subparser ``p``."""
    p.description = "Write a checkpoint as an inference model directory."
    p.add_argument("checkpoint", help="a checkpoint-N directory (or an output_dir: its last checkpoint); "
                   "a LoRA adapter checkpoint is merged into its base first")
    p.add_argument("--format", default="hf", help="hf (dense safetensors), neuzip (lossless NeuZip, loads compressed "
                   "with from_pretrained after `import neutrain`) or neuzip-lossy-<k> (k = 0, 1, 3, 7 mantissa bits)")
    p.add_argument("--base", help="base model directory of a LoRA adapter checkpoint (default: its adapter_config.json's); "
                   "refused unless it is the base the adapters were trained on (their run records it)")
    p.add_argument("--force-base", action="store_true", help="merge the adapters onto --base even when it is not the "
                   "base they were trained on (the export records the base it was given)")
    p.add_argument("--output", help="target directory (default: <checkpoint>/../export); an existing one is refused "
                   "unless it is a previous neutrain export and --overwrite is given")
    p.add_argument("--overwrite", action="store_true", help="replace a previous neutrain export at --output "
                   "(never anything else: a run, a checkpoint, a file or another directory is always refused)")
    shard, dtype = SCHEMA["export"]["max_shard_size"], SCHEMA["export"]["dtype"]  # as the recipe's export keys
    number_argument(p, "--max-shard-size", SHARD_SIZE, default=shard.default,
                    help=f"largest safetensors shard (default {shard.default})")
    p.add_argument("--dtype", default=dtype.default, choices=dtype.choices, help="weight dtype (auto keeps the checkpoint's)")


def run(args) -> int:
    """Export ``args.checkpoint`` (or a run's last checkpoint) in ``args.format``; refuses to replace anything else."""
    from neutrain.export import check_format, export_model  # lazy: `neutrain --help` stays instant
    from neutrain.storage.run_dir import enclosing_run, refuse_inside_model  # lazy: `neutrain --help` stays instant
    from neutrain.storage.run_lock import ExportLock  # lazy: `neutrain --help` stays instant
    from neutrain.trainer.ownership import note_resolved  # lazy: `neutrain --help` stays instant

    check_format(args.format)  # every argument and path is checked before anything heavy is imported
    if (line := export_dtype_refusal(args.format, args.dtype, "--format", "--dtype")) is not None:
        raise UserInputError(line)
    check_shard_size(args.max_shard_size)
    ckpt = last_checkpoint(Path(args.checkpoint))
    adapter = (ckpt / "adapter_config.json").exists()
    if not adapter:
        refuse_ignored(args, ["base", "force_base"], f"'{ckpt}' is a whole model, not LoRA adapters: there is "
                       "nothing to merge onto a base", "export it as it is")
    out = note_resolved("--output", args.output or str(ckpt.parent / "export"), False)  # the folders it lies in, once
    # Never inside a checkpoint, another export or another run's folder (the exported checkpoint's run's may hold it).
    refuse_inside_model(out, "--output", may_be_one=True, own=enclosing_run(ckpt))
    from neutrain.trainer.disk_plan import check_lengths, export_paths  # lazy: `neutrain --help` stays instant

    check_lengths("--output", str(out), export_paths(out))  # its lock and staging names too, as a run's export
    check_export_target(out, args.overwrite, key="--output", overwrite_hint="--overwrite")  # before loading anything
    # Never over or among what it reads (a run or a checkpoint is refused above as no export): the checkpoint, and
    # the base an adapter is merged onto (`--output RUN/base --overwrite` replaced a LoRA run's own base with the
    # merged model).
    from neutrain.cli.outputs import refuse_overlap  # lazy: `neutrain --help` stays instant

    reads = [("checkpoint", ckpt)]
    if adapter:
        from neutrain.export.lora import adapter_base  # lazy: `neutrain --help` stays instant

        base = adapter_base(ckpt, args.base)
        reads += [("--base" if args.base else "its base", base)] if base and os.path.lexists(base) else []
    for key, given in reads:
        refuse_overlap("--output", out, key, given)
    dtype = run_export_dtype(ckpt, args.dtype)
    # A dense checkpoint in its own dtype: the export checks the weights fit the one asked for before it casts them.
    model, tokenizer = load_model_checkpoint(ckpt, base=args.base, dtype=args.dtype if adapter else "auto",
                                             force_base=args.force_base)
    # The card's "Training" section from the run's record, and what the export was made from (path, content hash,
    # run), so that a later command can tell when that path holds other weights.
    info = {**run_facts(ckpt), **source_record(ckpt)}
    if getattr(model, "neutrain_base", None):  # an adapter checkpoint: the base it was merged onto
        info["base"] = model.neutrain_base
    chat = trained_with_chat_template(ckpt)
    if chat is not None:  # what `neutrain generate` reads to format prompts as the model was trained
        info["chat_template"] = chat
    with ExportLock(out, "--output"):  # one writer at a time: a run exporting there, or another export
        path = export_model(model, out, args.format, tokenizer=tokenizer, max_shard_size=args.max_shard_size,
                            info=info, overwrite=args.overwrite, dtype=dtype)
    print(f"exported {ckpt} -> {path} (format {args.format}, dtype {dtype if dtype != 'auto' else str(model.dtype).replace('torch.', '')})")
    return 0


def source_record(checkpoint: Path) -> dict:
    """What an export records of the checkpoint it was made from: its path, its content hash (the sha256 of its
    manifest) and the run that wrote it, so that a later command can tell when the path holds other weights.

    Example:
        >>> source_record(Path("outputs/default/checkpoint-240"))["checkpoint"]  # doctest: +SKIP
        '/home/me/outputs/default/checkpoint-240'
    """
    from neutrain.storage.manifest import content_hash  # lazy: `neutrain --help` stays instant
    from neutrain.storage.run_dir import read_ledger  # lazy: `neutrain --help` stays instant

    real = Path(os.path.realpath(checkpoint))
    # A run that saved no checkpoint of its last step (train.save_final: false) records only the run.
    info: dict = {"checkpoint": str(real), "checkpoint_sha256": content_hash(real)} if real.is_dir() else {}
    try:
        ledger = read_ledger(real.parent)
    except UserInputError:
        ledger = None
    if ledger is not None:
        info["run"] = {"output_dir": str(real.parent), "id": ledger.run}
    return info


def check_shard_size(text: str) -> None:
    """Refuse a ``--max-shard-size`` that is not a size such as ``500MB`` in :data:`SHARD_SIZE` (as
    ``export.max_shard_size``).

    Example:
        >>> check_shard_size("abc")
        Traceback (most recent call last):
        neutrain.errors.UserInputError: --max-shard-size: 'abc' is not a size; expected a number and KB, MB, GB or TB, e.g. 500MB or 5GB
    """
    try:
        SHARD_SIZE.parse("--max-shard-size", text)
    except FlagError as exc:
        raise UserInputError(str(exc)) from None


def run_export_dtype(checkpoint: Path, requested: str) -> str:
    """The dtype ``--dtype`` means for ``checkpoint``: for ``auto``, the dtype the run's own export used
    (read from the run's recipe), so ``neutrain export --dtype auto`` writes what the run wrote.

    Why: a CPU run computes in fp32 and exports bf16 (its base's dtype, or NeuZip's), but
    ``--dtype auto`` kept the checkpoint's fp32 tensors. A checkpoint no recipe describes keeps its own dtype.

    Example:
        >>> run_export_dtype(Path("outputs/default/checkpoint-240"), "auto")  # doctest: +SKIP
        'bfloat16'
    """
    if requested != "auto":
        return requested
    recipe = run_recipe(checkpoint)
    try:
        model, weights, use_cpu = recipe["model"], recipe["memory"]["weights"], recipe["train"]["use_cpu"]
        model = ModelSection.model_construct(**model)  # as the run validated it, from its recipe.yaml
    except (KeyError, TypeError):
        return "auto"
    from neutrain.trainer.modeling import export_dtype  # lazy: `neutrain --help` stays instant

    return export_dtype(model, weights, use_cpu, "auto")
