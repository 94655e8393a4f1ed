"""Draft distillation and a speculative-decoding check, as a recipe's ``distill`` section asks.

After a target is trained (or loaded from ``distill.target``), a small draft is
built from its config (a quarter of its layers unless ``distill.draft_config``
says otherwise), distilled on the recipe's training data with
:class:`~neutrain.distill.trainer.DistillationTrainer` (on-policy tails
included), evaluated for its acceptance rate alpha on the held-out data, and
exported beside the target. A speculative decode of a held-out prompt then
reports block efficiency (tokens per target call).

``neutrain distill`` (:mod:`neutrain.cli.distill`) runs it alone; ``neutrain train`` after its training when the
recipe's ``distill.enabled`` is set. Both import this module before torch is needed (``train`` for its summary
line, :func:`payoff_words`), so torch and the model code are imported when a distillation starts.

Example:
    >>> from neutrain.config import load_recipe
    >>> from neutrain.distill.draft import distill_from_recipe
    >>> # Needs a trained target (outputs/default/export) and trains a draft for minutes:
    >>> report = distill_from_recipe(load_recipe("default"))  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from neutrain.compat.quiet import progress_bars_wanted
from neutrain.config.model_config import DISTILL_PROMPT_TOKENS
from neutrain.config.schema import Recipe
from neutrain.errors import UserInputError
from neutrain.export.target import check_export_target
from neutrain.storage.leftovers import clean_export_leftovers
from neutrain.storage.run_dir import claim


def draft_config(target_config, overrides: dict | None):
    """The draft's config: the target's, with a quarter of its layers, then ``overrides``."""
    cfg = copy.deepcopy(target_config)
    cfg.num_hidden_layers = max(1, target_config.num_hidden_layers // 4)
    for key, value in (overrides or {}).items():
        setattr(cfg, key, value)
    return cfg


DRAFT_DIR, LOG_DIR = "draft", "distill"
"""Where a distillation writes, under ``train.output_dir``: the draft's export, and its training logs."""
LOG_FILES = ("metrics.jsonl", "training_curves.png")
"""What the distillation's trainer writes in :data:`LOG_DIR` (a rerun would append to the first)."""


def earlier_distillation(output_dir: str | os.PathLike, overwrite: bool) -> list[Path]:
    """The draft and log files an earlier distillation left in ``output_dir``; refused unless ``overwrite``.

    Why: a second ``neutrain distill`` silently replaced the draft and appended its run to the first one's
    ``distill/metrics.jsonl``, so neither the draft nor the log said which run they were. With
    ``overwrite`` the caller replaces both: the draft export (only a previous export, as ``neutrain
    export --overwrite`` does) and the log files named in :data:`LOG_FILES`, nothing else.

    Example:
        >>> import tempfile
        >>> earlier_distillation(tempfile.mkdtemp(), overwrite=False)
        []
    """
    out = Path(output_dir)
    found = [p for p in (out / DRAFT_DIR, *(out / LOG_DIR / name for name in LOG_FILES)) if p.exists()]
    if found and not overwrite:
        what = (f"'{out / DRAFT_DIR}' holds the draft of an earlier distillation (its logs are in '{out / LOG_DIR}')"
                if found[0].name == DRAFT_DIR else f"'{out / LOG_DIR}' holds the logs of an earlier distillation")
        raise UserInputError(f"distill: {what}; pass --overwrite to replace both, or move them elsewhere first")
    return found


def _load_target(recipe: Recipe):
    from neutrain.export import load_checkpoint_model  # lazy: torch, when a distillation starts (module docstring)

    path = recipe.distill.target or recipe.default_export_dir
    if not Path(path).exists():
        clean_export_leftovers(Path(path))  # set aside by an interrupted export: put back, and said so
    if not Path(path).is_dir():
        raise UserInputError(f"distill.target: '{path}' does not exist (train first, or set distill.target)")
    model, tokenizer = load_checkpoint_model(path)
    if tokenizer is None:
        raise UserInputError(f"distill.target: '{path}' has no tokenizer files")
    return model, tokenizer


def distill_from_recipe(recipe: Recipe, target=None, tokenizer=None, echo=print, overwrite: bool = False) -> dict[str, Any]:
    """Distil a draft from ``target`` (or the recipe's target directory); returns alpha and decode stats.

    ``overwrite``: replace the draft and logs of an earlier distillation in ``train.output_dir`` (else refused,
    see :func:`earlier_distillation`).
    """
    # lazy: torch and the model code, when a distillation starts (module docstring); the same for the lines below
    import torch
    from transformers import AutoModelForCausalLM, TrainingArguments

    from neutrain.data import Collator, build_datasets, pad_token_id  # lazy: torch, as above
    from neutrain.distill.trainer import DistillationTrainer  # lazy: torch, as above
    from neutrain.export import export_hf  # lazy: torch, as above
    from neutrain.export.hf import densify  # lazy: torch, as above
    from neutrain.speculative import generate  # lazy: torch, as above
    from neutrain.speculative.payoff import pays, round_cost  # lazy: torch, as above

    d, t = recipe.distill, recipe.train
    out = os.path.join(t.output_dir, DRAFT_DIR)
    earlier = earlier_distillation(t.output_dir, overwrite)  # before anything loads
    for name in (DRAFT_DIR, LOG_DIR, ".cache"):  # the run's own (refused when they are there and not the run's)
        claim(os.path.join(t.output_dir, name))
    if earlier:
        check_export_target(out, overwrite=True, key="distill: the draft directory")  # only a previous export is replaced
        echo(f"draft: replacing the earlier distillation's draft and logs in {t.output_dir}")
        for path in earlier:
            if path.is_file():  # the log files; the draft's export is replaced when the new one is written
                path.unlink()
    if target is None:
        target, tokenizer = _load_target(recipe)
    target = densify(target).eval()
    train_ds, heldout = build_datasets(recipe.data, tokenizer, os.path.join(t.output_dir, ".cache"))
    if heldout is not None and recipe.eval.max_eval_samples:
        heldout = heldout.select(range(min(len(heldout), recipe.eval.max_eval_samples)))
    torch.manual_seed(t.seed)
    draft = AutoModelForCausalLM.from_config(draft_config(target.config, d.draft_config), dtype=target.dtype)
    draft.to(next(target.parameters()).device)
    args = TrainingArguments(  # its logs go beside the draft: the export may replace only an export
        output_dir=os.path.join(t.output_dir, LOG_DIR), per_device_train_batch_size=t.micro_batch_size, per_device_eval_batch_size=t.micro_batch_size,
        learning_rate=d.learning_rate, max_steps=d.max_steps, lr_scheduler_type="cosine", warmup_steps=min(5, d.max_steps // 5),
        logging_steps=max(1, d.max_steps // 4), save_strategy="no", report_to="none", seed=t.seed, data_seed=t.seed,
        use_cpu=t.use_cpu, remove_unused_columns=False, disable_tqdm=not progress_bars_wanted(),
        dataloader_pin_memory=not t.use_cpu and torch.cuda.is_available(),  # else a warning nobody can act on
    )
    trainer = DistillationTrainer(
        model=draft, args=args, train_dataset=train_ds, eval_dataset=heldout, data_collator=Collator(pad_token_id(tokenizer)),
        processing_class=tokenizer, teacher_model=target, divergence=d.divergence,
        on_policy_every=d.on_policy_every, on_policy_tokens=min(32, recipe.data.sequence_len // 4),
    )
    alpha_before = trainer.evaluate()["eval_acceptance"] if heldout is not None else None
    trainer.train()
    report: dict[str, Any] = {"draft_parameters": sum(p.numel() for p in draft.parameters())}
    if heldout is not None:
        report["alpha_before"] = alpha_before
        report["alpha"] = trainer.evaluate()["eval_acceptance"]
    info = {"name": "neutrain draft", "distilled_from": recipe.distill.target or "the run's trained model",
            "recipe": recipe.source, "steps": d.max_steps, "acceptance": report.get("alpha")}
    report["draft_dir"] = export_hf(trainer.model, out, tokenizer=tokenizer, info=info, overwrite=True)
    if heldout is not None:
        prompt = torch.tensor([heldout[0]["input_ids"][:DISTILL_PROMPT_TOKENS]], device=next(target.parameters()).device)
        gen = torch.Generator(device="cpu").manual_seed(t.seed)
        res = generate(target, trainer.model.eval(), prompt, num_drafts=d.num_drafts, draft_len=d.draft_len,
                       scheme=d.scheme if d.num_drafts > 1 or d.scheme == "sd" else "sd",
                       temperature=d.temperature, max_new_tokens=d.max_new_tokens, generator=gen)
        # Whether the draft pays at all: a round costs the verification plus draft_len draft steps.
        cost = round_cost(target, [trainer.model], d.draft_len)
        report.update(block_efficiency=res.stats.block_efficiency, token_acceptance=res.stats.acceptance,
                      round_cost=cost, pays=pays(res.stats.block_efficiency, cost),
                      sample=tokenizer.decode(res.sequences[0, prompt.shape[1]:]))
        echo(f"draft: {report['draft_parameters'] / 1e6:.1f}M parameters, alpha {alpha_before:.3f} -> {report['alpha']:.3f} "
             f"after {d.max_steps} distillation steps; speculative decode ({d.scheme}, K={d.num_drafts}, "
             f"gamma={d.draft_len}): {payoff_words(report)}")
    return report


def payoff_words(report: dict[str, Any]) -> str:
    """The speculative decode's tokens per target call beside what a round costs, and whether the draft pays.

    Example:
        >>> payoff_words({"block_efficiency": 1.84, "round_cost": 2.77, "pays": False})
        '1.84 tokens per target call, below the 2.77 target steps a round costs: this draft does not pay, and `neutrain generate --draft` drops it after its first rounds'
    """
    words = f"{report['block_efficiency']:.2f} tokens per target call"
    if "round_cost" not in report:
        return words
    if report["pays"]:
        return f"{words}, above the {report['round_cost']:.2f} target steps a round costs: the draft pays"
    return (f"{words}, below the {report['round_cost']:.2f} target steps a round costs: this draft does not pay, and "
            "`neutrain generate --draft` drops it after its first rounds")

