"""``neutrain generate``: sample from a model, with exact (multi-draft) speculative decoding when a draft is given."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from neutrain.cli.checkpoints import check_vocabulary, last_checkpoint, trained_with_chat_template
from neutrain.config.schema import SCHEMA
from neutrain.config.validate import PACKAGE_PREFIX, package_file
from neutrain.errors import RecipeError, UserInputError


def configure(p) -> None:
    """The ``generate`` command's description and arguments, on its subparser ``p``."""
    p.description = ("Generate from MODEL (greedy unless --temperature > 0), the prompt wrapped in the "
                     "model's chat template unless --raw; with --draft, exact (multi-draft) speculative sampling.")
    p.add_argument("model", help="model directory (an export or checkpoint, or a run's output_dir), a GGUF file, "
                   "a directory holding one GGUF file, or package:<module>/<file>.gguf (a GGUF an installed package ships)")
    p.add_argument("--prompt", required=True, help="prompt text: one user turn in the model's chat template when the "
                   "tokenizer has one and the model was trained with it (the run records this); stderr says which")
    p.add_argument("--raw", action="store_true", help="tokenize --prompt as it is, without the chat template")
    p.add_argument("--draft", help="draft model directory (same tokenizer)")
    p.add_argument("--num-drafts", type=int, default=2, help="K drafts verified per target call (default 2)")
    p.add_argument("--draft-len", type=int, default=4, help="tokens per draft (default 4)")
    p.add_argument("--scheme", default=None, choices=("sd", "specinfer", "spectr", "importance"), help="verification scheme")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto (default): the GPU when there is one, in the form that fits its budget (dense, NeuZip "
                   "lossless, or NeuZip streamed from host memory; one line says which), else the CPU")
    p.add_argument("--device-budget-gib", type=float, default=None,
                   help="GPU memory the model may take, in GiB (default: the card's memory less the CUDA context "
                   "and a margin); enforced as the allocator's limit")


MAX_NEW_TOKENS = 1 << 20
"""The most tokens one call may ask for (as many as ``data.sequence_len`` allows a training row)."""


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt plus ``--max-new-tokens`` longer than the model's context, before a cache is allocated.

    Why: the decode engine allocates its cache for every token asked for at once; a number past the model's
    positions failed deep in the allocator (or decoded positions the model never learnt).

    Example:
        >>> from types import SimpleNamespace
        >>> check_context(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256)), 10, 300)
        Traceback (most recent call last):
        neutrain.errors.UserInputError: --max-new-tokens: 300 new tokens after a 10-token prompt exceed the model's context of 256 positions (max_position_embeddings); ask for at most 246
    """
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + max_new_tokens > context:
        raise UserInputError(f"--max-new-tokens: {max_new_tokens} new tokens after a {prompt_tokens}-token prompt exceed "
                             f"the model's context of {context} positions (max_position_embeddings); ask for at most "
                             f"{max(context - prompt_tokens, 0)}")


def check_arguments(args) -> None:
    """Refuse out-of-range numbers before a model is loaded (they used to fail deep in decoding, with a traceback).

    Example:
        >>> import argparse
        >>> check_arguments(argparse.Namespace(max_new_tokens=-1, temperature=0.0, num_drafts=2, draft_len=4, seed=0))
        Traceback (most recent call last):
        neutrain.errors.UserInputError: --max-new-tokens: -1 is out of range; expected an integer >= 1
    """
    if args.max_new_tokens > MAX_NEW_TOKENS:
        raise UserInputError(f"--max-new-tokens: {args.max_new_tokens} is out of range; expected at most "
                             f"{MAX_NEW_TOKENS:,} (the decode cache is allocated for all of them before the first token)")
    drafts, length = SCHEMA["distill"]["num_drafts"].max, SCHEMA["distill"]["draft_len"].max  # as the recipe's keys
    for flag, value, low, high in (("--max-new-tokens", args.max_new_tokens, 1, None),
                                   ("--num-drafts", args.num_drafts, 1, drafts),
                                   ("--draft-len", args.draft_len, 1, length),
                                   ("--seed", args.seed, 0, 2**63 - 1)):
        if value < low or (high is not None and value > high):
            rule = f"an integer from {low} to {high:,}" if high is not None else f"an integer >= {low}"
            raise UserInputError(f"{flag}: {value} is out of range; expected {rule}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UserInputError(f"--temperature: {args.temperature:g} is out of range; expected a finite number >= 0 "
                             "(0 = greedy)")
    budget = getattr(args, "device_budget_gib", None)
    if budget is not None and (not math.isfinite(budget) or budget <= 0):
        raise UserInputError(f"--device-budget-gib: {budget:g} is out of range; expected a finite number of GiB > 0")


def run(args) -> int:
    """Generate from ``args.model`` (speculatively with ``args.draft``) and print the continuation."""
    # Arguments and paths first: a mistake is refused in one line before torch and the model load.
    check_arguments(args)
    gguf = gguf_file(Path(args.model))
    directory = last_checkpoint(Path(args.model)) if gguf is None else None
    try:
        draft_dir = last_checkpoint(Path(args.draft)) if args.draft else None
    except UserInputError as exc:
        raise UserInputError(f"--draft: {exc}") from None

    import torch  # lazy: only once the arguments are known good

    from neutrain.compat.static_cache import static_cache_refusal  # lazy: same reason
    from neutrain.cli.placement import place_model  # lazy: same reason
    from neutrain.data.chat import prompt_ids, template_choice  # lazy: same reason
    from neutrain.export import load_checkpoint_model  # lazy: same reason
    from neutrain.speculative import generate  # lazy: same reason

    where = None
    if gguf is not None:
        (model, tokenizer), trained_with = _load_gguf(gguf), None
    else:
        # On a GPU, the form that fits the device budget (neutrain.cli.placement); on a CPU, as it is.
        model, tokenizer, where = place_model(directory, args.device, args.device_budget_gib)
        trained_with = trained_with_chat_template(directory)
    if where:
        print(where, file=sys.stderr)
    if tokenizer is None:
        raise UserInputError(f"model '{args.model}' has no tokenizer files")
    check_vocabulary(model, tokenizer, f"model '{args.model}'")
    use_template, why = template_choice(tokenizer, trained_with, raw=args.raw)
    ids = torch.tensor([prompt_ids(tokenizer, args.prompt, raw=not use_template)])
    print(f"[{why}]", file=sys.stderr)  # once the template rendered: a broken one is the error's one line
    check_context(model, ids.shape[1], args.max_new_tokens)
    torch.manual_seed(args.seed)
    if args.draft:
        draft, _ = load_checkpoint_model(draft_dir)
        draft = draft.to(next(model.parameters()).device)
        scheme = args.scheme or ("sd" if args.num_drafts == 1 else "importance")
        # The rounds run on decode engines (one CUDA graph and one host sync per round) when both models
        # have only full-attention layers; otherwise on growing DynamicCaches, with the same output law.
        engine = static_cache_refusal(model) is None and static_cache_refusal(draft) is None
        res = generate(model.eval(), draft.eval(), ids.to(next(model.parameters()).device), num_drafts=args.num_drafts, draft_len=args.draft_len, scheme=scheme,
                       temperature=args.temperature, max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                       generator=torch.Generator().manual_seed(args.seed), engine=engine)
        out, note = res.sequences, f"[{scheme}, K={args.num_drafts}: {res.stats.block_efficiency:.2f} tokens per target call, acceptance {res.stats.acceptance:.2f}]"
    else:
        out, note = _plain(model.eval(), ids, args, tokenizer), ""
    print(tokenizer.decode(out[0, ids.shape[1]:].cpu(), skip_special_tokens=True))
    if note:
        print(note, file=sys.stderr)
    if where:  # on a GPU: what the generation took, beside the budget the note named
        from neutrain.cli.placement import peak_line  # lazy: same reason

        print(peak_line(), file=sys.stderr)
    return 0


def gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` means: the file itself, ``package:<module>/<file>.gguf`` (a file an installed
    Python package ships), or the single ``*.gguf`` in a directory with no ``config.json``; ``None`` for
    anything else (a checkpoint or export).

    Example:
        >>> gguf_file(Path("outputs/default/export")) is None  # doctest: +SKIP
        True
    """
    if str(path).startswith(PACKAGE_PREFIX):  # a GGUF a pip package ships, named as model.gguf_file names it
        try:
            return Path(package_file(str(path), "model"))
        except RecipeError as exc:
            raise UserInputError(str(exc).replace("model: ", "", 1)) from None
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if not path.is_dir() or (path / "config.json").exists() or (path / "adapter_config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise UserInputError(f"model '{path}' holds {len(found)} GGUF files ({', '.join(f.name for f in found)}): name one")
    return found[0] if found else None


def _load_gguf(path: Path):
    """A GGUF file's model, dequantized (fp32 on a CPU, bf16 on a GPU), and its tokenizer."""
    import torch  # lazy: `neutrain --help` stays instant

    from neutrain.nn.gguf import GGUFLoadError, load_gguf_model, load_gguf_tokenizer  # lazy: same reason

    cuda = torch.cuda.is_available()
    try:
        model = load_gguf_model(str(path.parent), path.name, torch.bfloat16 if cuda else torch.float32)
        tokenizer = load_gguf_tokenizer(str(path.parent), path.name)
    except GGUFLoadError as exc:
        raise UserInputError(str(exc)) from None
    return (model.cuda() if cuda else model), tokenizer


def _plain(model, ids, args, tokenizer):
    """Autoregressive decoding in neutrain's decode engine (static cache, sampling on the device, a CUDA
    graph per token on a GPU): greedy equals Hugging Face's ``generate`` token for token, and T > 0 draws
    from the model's own ``softmax(logits / T)`` (no top-k or top-p). Models the engine cannot hold
    (sliding-window attention) go through ``model.generate``."""
    from neutrain.speculative import (
        DecodeEngine,  # lazy: `neutrain --help` stays instant
    )

    from neutrain.nn.weight_offload_model import weight_store  # lazy: same reason

    streamed = weight_store(model) is not None
    # Generation never trains: frozen, the engine fuses each layer's Q/K/V and gate/up projections into
    # one GEMV each (neutrain.eval.fused_projections). Streamed layers keep their own storage.
    model.requires_grad_(False)
    try:
        # Streamed layers are fetched by host decisions a CUDA graph cannot replay: those decode eagerly.
        engine = DecodeEngine(model, max_len=ids.shape[1] + args.max_new_tokens, seed=args.seed,
                              cuda_graph=False if streamed else None)
    except ValueError:
        kwargs = {"do_sample": args.temperature > 0, **({"temperature": args.temperature} if args.temperature > 0 else {})}
        return model.generate(ids.to(next(model.parameters()).device), max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id, **kwargs)
    device = next(model.parameters()).device
    return engine.generate(ids.to(device), args.max_new_tokens, temperature=args.temperature,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0).cpu()
