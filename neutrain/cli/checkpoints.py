"""Which directory a command means: a checkpoint or export itself, or a run's last checkpoint."""

from __future__ import annotations

from pathlib import Path

from neutrain.config.recipe_yaml import MAX_RECIPE_BYTES, parse_recipe_text
from neutrain.errors import RecipeError, UserInputError
from neutrain.export.target import EXPORT_INFO
from neutrain.files import MAX_RECORD_BYTES, check_kind, read_bytes, read_json_object
from neutrain.storage.run_lock import previous_checkpoints


def last_checkpoint(path: Path) -> Path:
    """``path`` itself when it is a checkpoint or export, else the last ``checkpoint-N`` inside it.

    Example:
        >>> last_checkpoint(Path("outputs/default"))  # doctest: +SKIP
        PosixPath('outputs/default/checkpoint-240')
    """
    if not path.exists():
        recover_export(path)  # an interrupted `export --overwrite` set it aside: put back, and said so
    # By kind before anything inside is looked at: a FIFO or a device was "no config.json inside" (neutrain.files).
    check_kind(path, f"checkpoint '{path}'", UserInputError, want="dir")
    if (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return _with_weights(path)
    if path.is_dir():
        # The directory scan transformers' get_last_checkpoint does, without importing transformers (and torch).
        found = previous_checkpoints(path)
        if found:
            return _with_weights(path / found[-1])
    raise UserInputError(f"checkpoint '{path}': no config.json and no checkpoint-N inside")


def _with_weights(checkpoint: Path) -> Path:
    """``checkpoint``, refused in one line when it holds a model config but no weights.

    Why here: the loader (:func:`neutrain.export.hf.load_checkpoint_model`) refuses it too, but only after
    torch and transformers are imported, seconds later on a small CPU. An adapter checkpoint's weights are
    checked by the adapter loader.
    """
    if (checkpoint / "config.json").exists() and not (checkpoint / "adapter_config.json").exists():
        if not any(checkpoint.glob("*.safetensors")) and not any(checkpoint.glob("*.safetensors.index.json")):
            raise UserInputError(f"checkpoint '{checkpoint}' has no safetensors weights")
    return checkpoint


def recover_export(path: Path) -> list[str]:
    """Put back an export that an interrupted replacement set aside beside ``path`` (and clear its half-written
    successor), each action logged; returns the actions.

    Why: a crash inside ``neutrain export RUN --overwrite``, after the old export was moved aside, left neither
    export, and each later command blamed something else ("does not exist", "not a checkpoint").
    """
    from neutrain.storage.leftovers import clean_export_leftovers  # lazy: `neutrain --help` stays instant

    return clean_export_leftovers(path)


def load_model_checkpoint(checkpoint: Path, base: str | None = None, dtype: str = "auto", force_base: bool = False):
    """``(model, tokenizer)`` of a checkpoint or export; a LoRA adapter checkpoint comes with its base.

    Why: a LoRA run's checkpoints hold only the adapters (``adapter_config.json``, no ``config.json``);
    ``neutrain eval`` of such a run failed with "has no config.json". The base is ``base``, else the one the
    adapter config names, else the ``<output_dir>/base`` the run wrote (:mod:`neutrain.export.lora`); it must be the
    base the adapters were trained on unless ``force_base``.

    Example:
        >>> model, tokenizer = load_model_checkpoint(Path("outputs/lora_neuzip/checkpoint-30"))  # doctest: +SKIP
    """
    if (Path(checkpoint) / "adapter_config.json").exists():
        from neutrain.export.lora import load_adapter_checkpoint  # lazy: `neutrain --help` stays instant

        return load_adapter_checkpoint(checkpoint, base=base, dtype=dtype, force_base=force_base,
                                       key="--base" if base else "its base")
    from neutrain.export import load_checkpoint_model  # lazy: `neutrain --help` stays instant

    return load_checkpoint_model(checkpoint, dtype=dtype)


def run_recipe(model_dir: Path) -> dict | None:
    """The resolved recipe the neutrain run that wrote ``model_dir`` saved beside it (``<output_dir>/recipe.yaml``),
    as a plain mapping; ``None`` for a directory no neutrain run wrote (or an unreadable recipe).

    Example:
        >>> run_recipe(Path("outputs/default/checkpoint-240"))["train"]["optimizer"]  # doctest: +SKIP
        'adalomo'
    """
    path = Path(model_dir).parent / "recipe.yaml"
    if not path.is_file():
        return None
    try:
        raw = parse_recipe_text(read_bytes(path, f"recipe file '{path}'", MAX_RECIPE_BYTES, RecipeError), str(path))
    except (OSError, RecipeError):
        return None
    return raw if isinstance(raw, dict) else None


def run_facts(checkpoint: Path) -> dict:
    """What the run that wrote ``checkpoint`` recorded about it, for an export's model card: the base model and
    the recipe (the run's ``recipe.yaml``), the steps, last training loss and held-out perplexity
    (``trainer_state.json``); an export's own ``neutrain_export.json`` facts carry over. Empty when nothing says.

    Why: ``neutrain export`` wrote a card whose "Training" section was an empty heading.

    Example:
        >>> run_facts(Path("outputs/default/checkpoint-240"))["steps"]  # doctest: +SKIP
        240
    """
    from neutrain.eval.perplexity import perplexity_record  # lazy: the eval package brings torch

    facts: dict = {}
    for name in (EXPORT_INFO, "trainer_state.json"):
        path = Path(checkpoint) / name
        try:  # best effort: a card without these facts; NaN allowed, a skipped step's loss is logged as NaN
            data = read_json_object(path, f"checkpoint file '{path}'", UserInputError, MAX_RECORD_BYTES, allow_nan=True)
        except UserInputError:
            continue
        if name == EXPORT_INFO:
            facts.update({k: v for k, v in data.items() if k != "format"})
            continue
        history = [h for h in data.get("log_history") or [] if isinstance(h, dict)]
        losses = [h["loss"] for h in history if isinstance(h.get("loss"), (int, float))]
        evals = [h["eval_loss"] for h in history if isinstance(h.get("eval_loss"), (int, float))]
        facts.update(steps=data.get("global_step"), final_loss=losses[-1] if losses else None,
                     heldout_perplexity=perplexity_record(evals[-1]) if evals else None)
    recipe = run_recipe(Path(checkpoint))
    model = recipe.get("model") if recipe else None
    if isinstance(model, dict):
        facts.setdefault("base_model", model.get("base_model") or model.get("gguf_file")
                         or ("random init" if model.get("init") == "random" else None))
        facts.setdefault("recipe", str(Path(checkpoint).parent / "recipe.yaml"))
    return {k: v for k, v in facts.items() if v is not None}


def trained_with_chat_template(model_dir: Path) -> bool | None:
    """Whether the model in ``model_dir`` was trained on chat-template-rendered data, as its run recorded it:
    the export's ``neutrain_export.json`` (``chat_template``), else the run's recipe (``type: messages``);
    ``None`` when nothing says (a model neutrain did not train).

    Example:
        >>> trained_with_chat_template(Path("outputs/default/export"))  # doctest: +SKIP
        False
    """
    from neutrain.data.chat import trained_on_chat  # lazy: neutrain.data imports datasets; `neutrain --help` stays instant

    info = Path(model_dir) / EXPORT_INFO
    if info.is_file():
        try:
            recorded = read_json_object(info, f"export info '{info}'", UserInputError).get("chat_template")
        except UserInputError:
            recorded = None
        if isinstance(recorded, bool):
            return recorded
    recipe = run_recipe(Path(model_dir))
    if recipe is None or not isinstance(recipe.get("data"), dict):
        return None
    return trained_on_chat(recipe["data"].get("datasets") or [])


def check_vocabulary(model, tokenizer, where: str) -> None:
    """Refuse a tokenizer that can put token ids past ``model``'s vocabulary into its inputs (they index outside
    the embedding).

    Why: a tokenizer from another model (``model.tokenizer``, or files swapped in an export) ended in
    ``IndexError: index out of range in self`` from the embedding, mid-generation or at the first step.
    Text reaches the model through the base vocabulary and the non-special added tokens (special-token
    strings in text are tokenised as text), and the pad, bos and eos ids go into inputs too. A special
    token past the vocabulary that is none of those (transformers' GGUF conversion appends an
    ``<|endoftext|>`` the file's model does not have) never reaches the embedding, and is allowed.

    Example:
        >>> from types import SimpleNamespace
        >>> check_vocabulary(SimpleNamespace(config=SimpleNamespace(vocab_size=64)), [0] * 259, "model.tokenizer")
        Traceback (most recent call last):
        neutrain.errors.UserInputError: model.tokenizer: the tokenizer has 259 tokens, the model's vocabulary 64 (vocab_size): token ids from 64 on would index outside its embedding; use the tokenizer the model was trained with
    """
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not isinstance(vocab, int) or len(tokenizer) <= vocab:
        return
    base = getattr(tokenizer, "vocab_size", None)
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(base, int) and isinstance(added, dict):
        in_inputs = {getattr(tokenizer, f"{name}_token_id", None) for name in ("pad", "bos", "eos")}
        past = [i for i, token in added.items() if i >= vocab and (not token.special or i in in_inputs)]
        if base <= vocab and not past:
            return
    raise UserInputError(f"{where}: the tokenizer has {len(tokenizer)} tokens, the model's vocabulary {vocab} "
                         f"(vocab_size): token ids from {vocab} on would index outside its embedding; use the "
                         f"tokenizer the model was trained with")
