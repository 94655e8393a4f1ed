"""``neutrain generate``: sample from a model, with exact (multi-draft) speculative decoding when a draft is given.

The model is loaded once for a ``--prompt`` or for every prompt of an ``--input-file`` (outputs in order, as
JSON lines); ``neutrain chat`` (:mod:`neutrain.cli.chat`) loads it the same way. A draft that does not pay
(:mod:`neutrain.speculative.payoff`) is measured on the first rounds and dropped, in one line.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from neutrain.cli.checkpoints import check_vocabulary, last_checkpoint, trained_with_chat_template
from neutrain.cli.ignored import refuse_ignored
from neutrain.config.numbers import NumberRule, number_argument
from neutrain.config.schema import SCHEMA
from neutrain.config.validate import PACKAGE_PREFIX, package_file
from neutrain.errors import RecipeError, UserInputError
from neutrain.files import parse_json, read_text


MAX_NEW_TOKENS = 1 << 20
"""The most tokens one call may ask for (as many as ``data.sequence_len`` allows a training row)."""

NUMBERS = {
    "--num-drafts": NumberRule(int, 1, SCHEMA["distill"]["num_drafts"].max),  # as the recipe's keys
    "--draft-len": NumberRule(int, 1, SCHEMA["distill"]["draft_len"].max),
    "--temperature": NumberRule(float, 0, SCHEMA["eval"]["sample_temperature"].max, why=" (0 = greedy)"),
    "--top-k": NumberRule(int, 0, 2**31 - 1, why=" (0 = all tokens)"),
    "--top-p": NumberRule(float, 0, 1, low_open=True, why=" (1 = no top-p)"),
    "--max-new-tokens": NumberRule(int, 1, MAX_NEW_TOKENS, why=" (the decode cache is allocated for all of them before "
                               "the first token)"),
    "--seed": NumberRule(int, 0, 2**63 - 1),
    "--device-budget-gib": NumberRule(float, 0, 1 << 20, low_open=True, why=" GiB"),
}
"""The numeric flags of ``generate`` and ``chat``, each with its range (:mod:`neutrain.config.numbers`)."""


def configure(p) -> None:
    """The ``generate`` command's description and arguments, on its subparser ``p``."""
    p.description = ("Generate from MODEL (greedy unless --temperature > 0), the prompt wrapped in the "
                     "model's chat template unless --raw; with --draft, exact (multi-draft) speculative sampling.")
    add_model_argument(p)
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="prompt text: one user turn in the model's chat template when the "
                         "tokenizer has one and the model was trained with it (the run records this); stderr says which")
    prompts.add_argument("--input-file", help="prompts from a file, the model loaded once: one prompt per line, or JSON "
                         "lines (.jsonl) with a \"prompt\" field; stdout gets one JSON line per prompt, in order, "
                         "{\"prompt\": ..., \"output\": ...} (a JSONL record's other fields kept)")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as it is, without the chat template")
    p.add_argument("--draft", help="draft model directory (same tokenizer); dropped, in one line, when its first "
                   "rounds show it does not pay")
    number_argument(p, "--num-drafts", NUMBERS["--num-drafts"], default=2, help="K drafts verified per target call (default 2)")
    number_argument(p, "--draft-len", NUMBERS["--draft-len"], default=4, help="tokens per draft (default 4)")
    p.add_argument("--scheme", default=None, choices=("sd", "specinfer", "spectr", "importance"), help="verification scheme")
    add_sampling_arguments(p)
    add_device_arguments(p)


def add_model_argument(p) -> None:
    """The ``model`` argument (``generate`` and ``chat``)."""
    p.add_argument("model", help="model directory (an export or checkpoint, or a run's output_dir), a GGUF file, "
                   "a directory holding one GGUF file, or package:<module>/<file>.gguf (a GGUF an installed package ships)")


def add_sampling_arguments(p) -> None:
    """``--temperature``, ``--top-k``, ``--top-p``, ``--max-new-tokens``, ``--seed`` and ``--compile`` (``generate`` and
    ``chat``)."""
    number_argument(p, "--temperature", NUMBERS["--temperature"], default=0.0,
                    help="sampling temperature; 0 = greedy (default 0)")
    number_argument(p, "--top-k", NUMBERS["--top-k"], default=0, help="sample from the k most likely tokens only "
                    "(default 0: all), as transformers' top_k")
    number_argument(p, "--top-p", NUMBERS["--top-p"], default=1.0, help="sample from the smallest set of tokens whose "
                    "probability reaches p (default 1.0: all), after --top-k, as transformers' top_p")
    number_argument(p, "--max-new-tokens", NUMBERS["--max-new-tokens"], default=64)
    number_argument(p, "--seed", NUMBERS["--seed"], default=0)
    p.add_argument("--compile", action="store_true",
                   help="compile the decoder layers for the one-token decode step (torch.compile): an 8B decodes "
                   "about 1.35x faster on an H200 (1.8 ms a token saved) after a one-time compile of 30-60 s, so it "
                   "pays after about 15,000 new tokens in one call; logits may differ in the last bits, so greedy "
                   "text may part from the default's after a near tie")


def add_device_arguments(p) -> None:
    """``--device`` and ``--device-budget-gib`` (``generate`` and ``chat``)."""
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto (default): the GPU when there is one, in the form that fits its budget (dense, NeuZip "
                   "lossless, or NeuZip streamed from host memory; one line says which), else the CPU")
    number_argument(p, "--device-budget-gib", NUMBERS["--device-budget-gib"], default=None,
                    help="GPU memory the model may take, in GiB (default: the card's memory less the CUDA context "
                   "and a margin); enforced as the allocator's limit")


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse an empty prompt, or one plus ``--max-new-tokens`` longer than the model's context, before a cache
    is allocated.

    Why: the decode engine allocates its cache for every token asked for at once; a number past the model's
    positions failed deep in the allocator (or decoded positions the model never learnt).

    Example:
        >>> from types import SimpleNamespace
        >>> check_context(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=256)), 10, 300)
        Traceback (most recent call last):
        neutrain.errors.UserInputError: --max-new-tokens: 300 new tokens after a 10-token prompt exceed the model's context of 256 positions (max_position_embeddings); ask for at most 246
    """
    if prompt_tokens == 0:  # nothing to continue from: the decoder's prefill raised a ValueError on it
        raise UserInputError("--prompt: the prompt is empty (0 tokens after the tokenizer); give some text")
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens >= context:  # no number of new tokens would fit: the prompt's fault
        raise UserInputError(f"--prompt: the prompt alone has {prompt_tokens} tokens, and the model's context is "
                             f"{context} positions (max_position_embeddings); shorten it to fewer than {context} "
                             "tokens")
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
        neutrain.errors.UserInputError: --max-new-tokens: -1 is out of range; expected an integer from 1 to 1,048,576 (the decode cache is allocated for all of them before the first token)
        >>> check_arguments(argparse.Namespace(max_new_tokens=8, temperature=1.0, top_p=1.5))
        Traceback (most recent call last):
        neutrain.errors.UserInputError: --top-p: 1.5 is out of range; expected a finite number > 0 to 1 (1 = no top-p)
    """
    for flag, number in NUMBERS.items():  # the CLI parsed them so; a Namespace built in Python is held the same
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            number.check(flag, value, error=UserInputError)
    if not getattr(args, "draft", None):
        refuse_ignored(args, ["scheme", "num_drafts", "draft_len"], "there is no --draft: decoding is plain",
                       "give --draft DRAFT to decode speculatively")
    else:
        refuse_ignored(args, ["compile"], "the speculative rounds decode with engines of their own, not compiled",
                       "drop --draft to decode through the compiled layers")
    if args.temperature == 0:
        refuse_ignored(args, ["top_k", "top_p"], "--temperature 0 decodes greedily and samples nothing",
                       "give --temperature > 0 to sample")
    budget = getattr(args, "device_budget_gib", None)
    if budget is not None and (not math.isfinite(budget) or budget <= 0):
        raise UserInputError(f"--device-budget-gib: {budget:g} is out of range; expected a finite number of GiB > 0")


@dataclass
class Loaded:
    """A model loaded for generation, its tokenizer, whether prompts go through its chat template and why,
    where it was placed (a line for stderr, or None) and the placement decided on a GPU
    (:class:`~neutrain.memory.residency.Residency`: its ``positions`` are the most one sequence may hold)."""

    model: object
    tokenizer: object
    use_template: bool
    why: str
    where: str | None
    residency: object | None = None


def model_source(args) -> tuple[Path | None, Path | None]:
    """``(GGUF file, checkpoint directory)`` of ``args.model``, one of them None: checked before torch loads, so
    a wrong path is refused in one line at once."""
    gguf = gguf_file(Path(args.model))
    return gguf, (last_checkpoint(Path(args.model)) if gguf is None else None)


def load_for_generation(args, source: tuple[Path | None, Path | None] | None = None, prompts: list[str] | None = None,
                        extra_bytes: float = 0.0) -> Loaded:
    """Load ``args.model`` once (a GGUF file, an export, a checkpoint or a run's output_dir) as ``generate`` and
    ``chat`` use it (``source``: :func:`model_source`'s answer, when already asked); stderr gets the placement
    line, if any.

    On a GPU the placement holds the KV cache of the longest of ``prompts`` (None: a chat, up to
    :data:`~neutrain.cli.placement.CHAT_POSITIONS` positions) and ``--max-new-tokens``, beside ``extra_bytes`` (a draft model).
    """
    from neutrain.cli.placement import longest_prompt, place_model  # lazy: `neutrain --help` stays instant
    from neutrain.data.chat import template_choice  # lazy: same reason

    gguf, directory = source or model_source(args)
    where = residency = None
    if gguf is not None:
        (model, tokenizer), trained_with = _load_gguf(gguf), None
    else:
        trained_with = trained_with_chat_template(directory)
        # On a GPU, the placement that fits the device budget (neutrain.cli.placement); on a CPU, as it is.
        model, tokenizer, where, residency = place_model(
            directory, args.device, args.device_budget_gib, new_tokens=args.max_new_tokens, extra_bytes=extra_bytes,
            prompt_tokens=lambda tokenizer: longest_prompt(tokenizer, trained_with, args, prompts, directory))
    if where:
        print(where, file=sys.stderr)
    if tokenizer is None:
        raise UserInputError(f"model '{args.model}' has no tokenizer files")
    check_vocabulary(model, tokenizer, f"model '{args.model}'")
    use_template, why = template_choice(tokenizer, trained_with, raw=args.raw)
    return Loaded(model.eval(), tokenizer, use_template, why, where, residency)


MAX_PROMPT_FILE_BYTES = 256 << 20
"""A file of prompts: each is generated from in turn, so a file past this is not one a run gets through."""


def read_prompts(path: str) -> list[dict]:
    """The prompts of ``--input-file``, each as a record with a ``prompt``: a .jsonl/.json file's JSON lines (each
    an object with a string ``prompt``; its other fields are kept), else the file's non-blank lines.

    Example:
        >>> import tempfile, pathlib
        >>> f = pathlib.Path(tempfile.mkdtemp()) / "p.jsonl"
        >>> _ = f.write_text('{"prompt": "hi", "id": 1}\\n{"text": "x"}\\n')
        >>> read_prompts(str(f))
        Traceback (most recent call last):
        neutrain.errors.UserInputError: --input-file: ... line 2: expected a JSON object with a non-empty string "prompt" field
    """
    file = Path(path)
    label = f"--input-file: '{path}'"
    # the one reader of user-named files: a FIFO blocked here, /dev/zero read until memory ran out
    lines = read_text(file, label, MAX_PROMPT_FILE_BYTES, UserInputError).splitlines()
    if file.suffix.lower() not in (".jsonl", ".json"):
        records = [{"prompt": line} for line in lines if line.strip()]
    else:
        records = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            record = parse_json(line, f"{label} line {number}", UserInputError)  # names the column, a surrogate's key
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
                raise UserInputError(f"--input-file: '{path}' line {number}: expected a JSON object with a non-empty "
                                     "string \"prompt\" field")
            records.append(record)
    if not records:  # an empty file fell through to --prompt, which was not given: a TypeError traceback
        raise UserInputError(f"{label} holds no prompt (it is empty, or every line is blank)")
    return records


def decode(loaded: Loaded, ids, args, draft=None) -> tuple[object, list[str]]:
    """Decode after prompt ``ids [1, n]`` as ``args`` say; returns the prompt and new tokens and the lines for stderr.

    With ``draft``: speculative rounds, measured on the first ones (:class:`~neutrain.speculative.payoff.Probe`);
    a draft that does not pay is dropped and plain decoding continues from the committed tokens (the same law).
    """
    import torch  # lazy: `neutrain --help` stays instant

    from neutrain.compat.static_cache import static_cache_refusal  # lazy: same reason
    from neutrain.speculative import generate  # lazy: same reason
    from neutrain.speculative.payoff import Probe, round_cost  # lazy: same reason

    model, tokenizer = loaded.model, loaded.tokenizer
    torch.manual_seed(args.seed)
    truncated = args.top_k or args.top_p < 1.0
    if draft is None or (truncated and args.temperature > 0):
        notes = ["[--top-k/--top-p: speculative verification samples the untruncated law; decoding without the "
                 "draft]"] if draft is not None else []
        return _plain(model, ids, args, tokenizer), notes
    scheme = args.scheme or ("sd" if args.num_drafts == 1 else "importance")
    # The rounds run on decode engines (one CUDA graph and one host sync per round) when both models
    # have only full-attention layers; otherwise on growing DynamicCaches, with the same output law.
    engine = static_cache_refusal(model) is None and static_cache_refusal(draft) is None
    probe = Probe(round_cost(model, [draft], args.draft_len))
    res = generate(model, draft, ids.to(next(model.parameters()).device), num_drafts=args.num_drafts,
                   draft_len=args.draft_len, scheme=scheme, temperature=args.temperature,
                   max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                   generator=torch.Generator().manual_seed(args.seed), engine=engine, keep_going=probe)
    out = res.sequences
    if not res.stopped:
        return out, [f"[{scheme}, K={args.num_drafts}: {res.stats.block_efficiency:.2f} tokens per target call, "
                     f"acceptance {res.stats.acceptance:.2f}]"]
    rest = args.max_new_tokens - (out.shape[1] - ids.shape[1])
    return _plain(model, out.cpu(), args, tokenizer, max_new_tokens=rest), [probe.line(args.draft_len, res.stats.acceptance)]


def run(args) -> int:
    """Generate from ``args.model`` (speculatively with ``args.draft``) and print the continuation(s)."""
    # Arguments, paths and prompts first: a mistake is refused in one line before torch and the model load.
    check_arguments(args)
    source = model_source(args)
    try:
        draft_dir = last_checkpoint(Path(args.draft)) if args.draft else None
    except UserInputError as exc:
        raise UserInputError(f"--draft: {exc}") from None
    records = read_prompts(args.input_file) if args.input_file else None

    import torch  # lazy: only once the arguments are known good

    from neutrain.cli.placement import draft_bytes  # lazy: same reason
    from neutrain.data.chat import prompt_ids  # lazy: same reason
    from neutrain.export import load_checkpoint_model  # lazy: same reason

    asked = records or [{"prompt": args.prompt}]
    loaded = load_for_generation(args, source, [r["prompt"] for r in asked], draft_bytes(draft_dir))
    draft = None
    if draft_dir is not None:
        draft, _ = load_checkpoint_model(draft_dir)
        draft = draft.to(next(loaded.model.parameters()).device).eval()
    made, seconds = 0, 0.0
    for i, record in enumerate(asked):
        ids = torch.tensor([prompt_ids(loaded.tokenizer, record["prompt"], raw=not loaded.use_template)])
        if i == 0:
            print(f"[{loaded.why}]", file=sys.stderr)  # once the template rendered: a broken one is the error's one line
        check_context(loaded.model, ids.shape[1], args.max_new_tokens)
        start = time.perf_counter()
        out, notes = decode(loaded, ids, args, draft)
        new = out[0, ids.shape[1]:].cpu()  # on the host: the device's work is done
        made, seconds = made + new.numel(), seconds + time.perf_counter() - start
        text = loaded.tokenizer.decode(new, skip_special_tokens=True)
        print(text if records is None else json.dumps({**record, "output": text}, ensure_ascii=False), flush=True)
        if not text.strip():  # a blank line alone looked like a fault of the command, or of the terminal
            print(f"[{_no_text(new.tolist(), loaded.tokenizer)}]", file=sys.stderr)
        for note in notes:
            print(note, file=sys.stderr)
    from neutrain.cli.placement import peak_line, rate_line  # lazy: same reason

    print(rate_line(made, seconds, loaded.residency), file=sys.stderr)
    if loaded.where:  # on a GPU: what the generation took, beside the budget the note named
        print(peak_line(loaded.residency), file=sys.stderr)
    return 0


def _no_text(new: list[int], tokenizer) -> str:
    """Why the generation printed no text: what its tokens were.

    Example:
        >>> from types import SimpleNamespace
        >>> _no_text([2], SimpleNamespace(eos_token_id=2, all_special_ids=[0, 2]))
        'the model generated no text: its first new token ended the sequence (EOS)'
    """
    if not new:
        return "the model generated no token"
    if new[0] == tokenizer.eos_token_id:
        return "the model generated no text: its first new token ended the sequence (EOS)"
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    if all(t in special for t in new):
        return f"the model generated {len(new)} token(s), all special tokens (not text)"
    return f"the model generated {len(new)} token(s) of whitespace only"


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


def _plain(model, ids, args, tokenizer, max_new_tokens: int | None = None):
    """Autoregressive decoding in neutrain's decode engine (static cache, sampling on the device, a CUDA
    graph per token on a GPU): greedy equals Hugging Face's ``generate`` token for token, and T > 0 draws
    from the model's own ``softmax(logits / T)``, truncated by ``--top-k`` and ``--top-p`` as transformers'
    warpers do. Models the engine cannot hold (sliding-window attention) go through ``model.generate``."""
    from neutrain.decode import DecodeEngine  # lazy: `neutrain --help` stays instant

    from neutrain.nn.weight_offload_model import weight_store  # lazy: same reason

    new = args.max_new_tokens if max_new_tokens is None else max_new_tokens
    streamed = weight_store(model) is not None
    compile_layers = bool(getattr(args, "compile", False))
    if compile_layers and (streamed or next(model.parameters()).device.type != "cuda"):
        # The compiled layers pay by fusing kernel launches inside the GPU's captured step; on the CPU, or with
        # layers fetched from host memory by host decisions, there is no such step (and a CPU compile needs a
        # C++ compiler the machine may lack).
        where = "streams its layers from host memory under this budget" if streamed else "decodes on the CPU"
        raise UserInputError(f"--compile: this run {where}, and the compiled layers serve a model resident on the "
                             "GPU; drop --compile")
    # Generation never trains: frozen, the engine fuses each layer's Q/K/V and gate/up projections into
    # one GEMV each (neutrain.decode.fused_projections). Streamed layers keep their own storage.
    model.requires_grad_(False)
    try:
        # Streamed layers are fetched by host decisions a CUDA graph cannot replay: those decode eagerly.
        engine = DecodeEngine(model, max_len=ids.shape[1] + new, seed=args.seed, cuda_graph=False if streamed else None,
                              compile_layers=compile_layers)
    except ValueError:
        # top_k 0 and top_p 1.0 stated: a model's generation_config may default to others (top_k 50).
        kwargs = ({"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
                  if args.temperature > 0 else {"do_sample": False})
        return model.generate(ids.to(next(model.parameters()).device), max_new_tokens=new,
                              pad_token_id=tokenizer.pad_token_id, **kwargs).cpu()
    device = next(model.parameters()).device
    return engine.generate(ids.to(device), new, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0).cpu()
