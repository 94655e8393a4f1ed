"""The ``neutrain`` command line.

    neutrain recipes/default.yaml [section.key=value ...]      # same as `neutrain train ...`
    neutrain train  <recipe> [overrides]                        # train, evaluate, export
    neutrain eval   <recipe | checkpoint> [overrides]           # held-out perplexity (+ long-context tasks)
    neutrain export <checkpoint> --format hf|neuzip|neuzip-lossy-<k> [--output DIR]  # inference export
    neutrain estimate <recipe> [overrides]                      # predict peak GPU memory, loading nothing
    neutrain distill  <recipe> [overrides]                      # distil a draft from the trained target
    neutrain generate <model> --prompt TEXT [--draft DIR]       # (speculative) sampling
    neutrain recipes                                            # list shipped recipes

Bad input (recipe, data, checkpoint, arguments) prints one line naming the key,
file or value and exits with code 2; a failure of the environment (full disk,
read-only file system, unusable output_dir) prints one line naming the path and
exits with code 1. NEUTRAIN_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import textwrap
from pathlib import Path

from neutrain.cli.environment import EXIT_ENVIRONMENT, describe_environment_error
from neutrain.config.schema import SCHEMA
from neutrain.errors import UserInputError, one_line

EXIT_USER_ERROR = 2


def _keys_help() -> str:
    lines = ["recipe keys (override any with section.key=value):"]
    for section, keys in SCHEMA.items():
        lines.append(f"  {section}:")
        for name, key in keys.items():
            default = "required" if key.default is not None and key.default.__class__ is object else repr(key.default)
            lines.append(textwrap.fill(f"{name} (default {default}): {key.help}", width=100, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neutrain",
        description="neutrain: full fine-tuning of LLMs in far less memory (NeuZip-compressed weights, fused updates).",
        epilog="Run `neutrain train --help` for every recipe key. Launch on GPUs with "
        "`accelerate launch -m neutrain recipes/<name>.yaml` (configs in launch/).\n\n"
        "Errors are one line on stderr: exit 2 for bad input (recipe, data, checkpoint, arguments), exit 1 for the "
        "environment (full disk, read-only file system, unusable output_dir). Set NEUTRAIN_DEBUG=1 to see the traceback.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="{train,eval,export,estimate,distill,generate,recipes}")
    t = sub.add_parser("train", help="train with a recipe (default when the first argument is a YAML file)",
                       description="Train, evaluate held-out perplexity, export and print a summary.",
                       epilog=_keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe (see `neutrain recipes`)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.learning_rate=1e-5 train.max_steps=100")
    e = sub.add_parser("eval", help="evaluate a recipe's model or a checkpoint",
                       description="Held-out loss/perplexity for a checkpoint (with the recipe's data), plus long-context tasks.")
    e.add_argument("target", help="recipe YAML (evaluates its output_dir's last checkpoint) or a checkpoint/export directory")
    e.add_argument("overrides", nargs="*", help="dotted overrides")
    e.add_argument("--recipe", help="recipe that supplies data and eval settings when TARGET is a checkpoint")
    x = sub.add_parser("export", help="export a checkpoint for inference",
                       description="Write a checkpoint as an inference model directory.")
    x.add_argument("checkpoint", help="a checkpoint-N directory (or an output_dir: its last checkpoint); "
                   "a LoRA adapter checkpoint is merged into its base first")
    x.add_argument("--format", default="hf", help="hf (dense safetensors), neuzip (lossless NeuZip, loads compressed "
                   "with from_pretrained after `import neutrain`) or neuzip-lossy-<k> (k = 0, 1, 3, 7 mantissa bits)")
    x.add_argument("--base", help="base model directory of a LoRA adapter checkpoint (default: its adapter_config.json's)")
    x.add_argument("--output", help="target directory (default: <checkpoint>/../export); an existing one is refused "
                   "unless it is a previous neutrain export and --overwrite is given")
    x.add_argument("--overwrite", action="store_true", help="replace a previous neutrain export at --output "
                   "(never anything else: a run, a checkpoint, a file or another directory is always refused)")
    shard, dtype = SCHEMA["export"]["max_shard_size"], SCHEMA["export"]["dtype"]  # as the recipe's export keys
    x.add_argument("--max-shard-size", default=shard.default, help=f"largest safetensors shard (default {shard.default})")
    x.add_argument("--dtype", default=dtype.default, choices=dtype.choices, help="weight dtype (auto keeps the checkpoint's)")
    s = sub.add_parser("estimate", help="predict peak GPU memory of a recipe before loading anything",
                       description="Predict peak GPU memory from the model config and the recipe (no weights are loaded).")
    s.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    s.add_argument("overrides", nargs="*", help="dotted overrides")
    d = sub.add_parser("distill", help="distil a small draft from a trained target (recipe's distill section)",
                       description="Distil a draft from distill.target (default <train.output_dir>/export), report alpha, "
                       "export it to <train.output_dir>/draft and decode speculatively with it.")
    d.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    d.add_argument("overrides", nargs="*", help="dotted overrides, e.g. distill.max_steps=200")
    g = sub.add_parser("generate", help="generate text, speculatively when a draft is given",
                       description="Sample from MODEL; with --draft, exact (multi-draft) speculative sampling.")
    g.add_argument("model", help="model directory (an export or checkpoint)")
    g.add_argument("--prompt", required=True, help="prompt text")
    g.add_argument("--draft", help="draft model directory (same tokenizer)")
    g.add_argument("--num-drafts", type=int, default=2, help="K drafts verified per target call (default 2)")
    g.add_argument("--draft-len", type=int, default=4, help="tokens per draft (default 4)")
    g.add_argument("--scheme", default=None, choices=("sd", "specinfer", "spectr", "importance"), help="verification scheme")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    sub.add_parser("recipes", help="list the shipped recipes", description="List shipped recipes, one line each.")
    return p


def _argv_with_default_command(argv: list[str]) -> list[str]:
    commands = {"train", "eval", "export", "estimate", "distill", "generate", "recipes", "-h", "--help"}
    if argv and argv[0] not in commands and (argv[0].endswith((".yaml", ".yml")) or Path(argv[0]).is_file()):
        return ["train", *argv]
    return argv


def cmd_recipes() -> int:
    from neutrain.config import recipe_dirs

    found = False
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found = True
            description = ""
            for line in path.read_text().splitlines()[1:6]:
                if line.startswith("#") and line.strip("# "):
                    description = line.lstrip("# ").strip()
                    break
            print(f"{path.stem:<22} {description}  ({path})")
    if not found:
        print("no recipes found (looked in: ./recipes and $NEUTRAIN_RECIPES)")
    return 0


def cmd_train(args) -> int:
    from neutrain.config import load_recipe
    from neutrain.cli.train import train_from_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    args.writes_to = recipe.train["output_dir"]  # named by an environment error that carries no path
    summary = train_from_recipe(recipe)
    if summary.get("world_size", 1) > 1:
        from neutrain.distributed import exit_rank

        exit_rank(0)  # no interpreter finalization for a finished rank (see exit_rank)
    return 0


def _last_checkpoint(path: Path) -> Path:
    from transformers.trainer_utils import get_last_checkpoint

    if not path.exists():
        raise UserInputError(f"checkpoint '{path}' does not exist")
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return path
    if path.is_dir():
        last = get_last_checkpoint(str(path))
        if last:
            return Path(last)
    raise UserInputError(f"checkpoint '{path}': no config.json and no checkpoint-N inside")


def cmd_export(args) -> int:
    from neutrain.export import export_model, load_checkpoint_model
    from neutrain.export.target import check_export_target

    ckpt = _last_checkpoint(Path(args.checkpoint))
    out = args.output or str(ckpt.parent / "export")
    check_export_target(out, args.overwrite, key="--output", overwrite_hint="--overwrite")  # before loading anything
    if (ckpt / "adapter_config.json").exists():
        from neutrain.export.lora import load_adapter_checkpoint

        model, tokenizer = load_adapter_checkpoint(ckpt, base=args.base, dtype=args.dtype)
    else:
        model, tokenizer = load_checkpoint_model(ckpt, dtype=args.dtype)
    path = export_model(model, out, args.format, tokenizer=tokenizer, max_shard_size=args.max_shard_size,
                        info={"checkpoint": str(ckpt)}, overwrite=args.overwrite)
    print(f"exported {ckpt} -> {path} (format {args.format})")
    return 0


def cmd_estimate(args) -> int:
    from neutrain.config import load_recipe
    from neutrain.trainer.planner import estimate_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    est = estimate_recipe(recipe)
    st = est.settings
    print(f"{recipe.source}: {st['params'] / 1e9:.2f}B parameters, batch {st['batch']} x {st['seq']} tokens, "
          f"weights {st['weights']}, optimizer {recipe.train['optimizer']}, checkpointing {st['checkpointing']}")
    print(est.table())
    return 0


def cmd_distill(args) -> int:
    from neutrain.config import load_recipe
    from neutrain.cli.distill import distill_from_recipe

    distill_from_recipe(load_recipe(args.recipe, args.overrides))
    return 0


def cmd_generate(args) -> int:
    import torch

    from neutrain.export import load_checkpoint_model
    from neutrain.speculative import generate

    model, tokenizer = load_checkpoint_model(_last_checkpoint(Path(args.model)))
    if tokenizer is None:
        raise UserInputError(f"model '{args.model}' has no tokenizer files")
    ids = torch.tensor([tokenizer(args.prompt)["input_ids"]])
    torch.manual_seed(args.seed)
    if args.draft:
        draft, _ = load_checkpoint_model(_last_checkpoint(Path(args.draft)))
        scheme = args.scheme or ("sd" if args.num_drafts == 1 else "importance")
        res = generate(model.eval(), draft.eval(), ids, num_drafts=args.num_drafts, draft_len=args.draft_len, scheme=scheme,
                       temperature=args.temperature, max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                       generator=torch.Generator().manual_seed(args.seed))
        out, note = res.sequences, f"[{scheme}, K={args.num_drafts}: {res.stats.block_efficiency:.2f} tokens per target call, acceptance {res.stats.acceptance:.2f}]"
    else:
        kwargs = {"do_sample": args.temperature > 0, **({"temperature": args.temperature} if args.temperature > 0 else {})}
        out, note = model.generate(ids, max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs), ""
    print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    if note:
        print(note, file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from neutrain.cli.eval import run_eval

    return run_eval(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``neutrain`` console script and ``python -m neutrain``."""
    argv = _argv_with_default_command(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USER_ERROR
    logging.basicConfig(level=os.environ.get("NEUTRAIN_LOG_LEVEL", "INFO"), format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        if args.command == "recipes":
            return cmd_recipes()
        if args.command == "train":
            return cmd_train(args)
        if args.command == "export":
            return cmd_export(args)
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "estimate":
            return cmd_estimate(args)
        if args.command == "distill":
            return cmd_distill(args)
        if args.command == "generate":
            return cmd_generate(args)
    except UserInputError as exc:
        if os.environ.get("NEUTRAIN_DEBUG") == "1":
            raise
        print(f"neutrain: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("neutrain: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # A full disk or read-only file system reaches here as OSError, or wrapped by safetensors / torch.save.
        if os.environ.get("NEUTRAIN_DEBUG") == "1":
            raise
        line = describe_environment_error(exc, getattr(args, "writes_to", None) or getattr(args, "output", None))
        if line is not None:
            print(f"neutrain: error: {line}", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if isinstance(exc, OSError):  # no errno: a library's "not found / not a model" report about user input
            print(f"neutrain: error: {one_line(exc)}", file=sys.stderr)
            return EXIT_USER_ERROR
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
