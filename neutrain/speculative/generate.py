"""Speculative generation with one or several drafts, verified in one target forward.

Each round:

1. **Draft.** A single draft model proposes K continuations of ``draft_len``
   tokens as K independent samples (its cache is repeated K times along the
   batch); a list of K draft models proposes one each. At temperature 0 the K
   drafts start from the draft's K most likely first tokens and continue greedily.
2. **Verify.** The target scores every drafted token in one forward (4D additive
   mask, explicit position ids): on ``DynamicCache`` s the K drafts are merged into a
   :class:`TokenTree`; on the decode engines (``engine=True``,
   :mod:`neutrain.speculative.rounds`) they stay K chains of a fixed layout so that the
   round replays one CUDA graph and synchronises with the host once.
3. **Walk** (:func:`neutrain.speculative.walk.walk`, on the host, exact): the token-level
   scheme runs depth by depth on the drafts that still match the committed prefix.
4. **Compact.** The target cache keeps the prefix plus the accepted path; each
   draft cache keeps the row and prefix that match the committed tokens.

Invariant: the target cache holds every committed token but the last, which is
the next tree's root. Temperature 0 commits the target's argmax at every node,
which is the target's greedy decode token for token.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from neutrain.speculative.backends import DynamicDraft, DynamicTarget, model_device
from neutrain.speculative.device_walk import DEVICE_SCHEMES
from neutrain.speculative.rounds import EngineRounds, rounds_room
from neutrain.speculative.tree import TokenTree
from neutrain.speculative.walk import WalkResult, walk


@dataclass
class SpeculativeStats:
    """Counters of one :func:`generate` call.

    ``block_efficiency`` is tokens committed per target verification call;
    ``acceptance`` is the fraction of verified positions whose output was an
    accepted draft token.
    """

    target_calls: int = 0
    draft_calls: int = 0
    committed_tokens: int = 0
    verified_positions: int = 0
    accepted_positions: int = 0

    @property
    def block_efficiency(self) -> float:
        return self.committed_tokens / max(self.target_calls, 1)

    @property
    def acceptance(self) -> float:
        return self.accepted_positions / max(self.verified_positions, 1)

    def as_dict(self) -> dict:
        return {**self.__dict__, "block_efficiency": self.block_efficiency, "acceptance": self.acceptance}


@dataclass
class SpeculativeOutput:
    """The prompt and new tokens, the counters, and whether ``keep_going`` stopped the rounds early."""

    sequences: torch.Tensor
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)
    stopped: bool = False


def warp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling distribution in float64 (softmax of ``logits / temperature``)."""
    return torch.softmax(logits.to(torch.float64) / temperature, dim=-1)


class _DraftState:
    """A draft model's cache (:mod:`neutrain.speculative.backends`) and how many committed tokens it holds."""

    def __init__(self, cache: DynamicDraft):
        self.cache, self.length = cache, 0

    def propose(self, seq: list[int], rows: int, steps: int, temperature: float, generator):
        """Sample ``rows`` continuations of ``steps`` tokens; returns tokens ``[rows, steps]`` and q's."""
        first = self.cache.feed(seq[self.length :], self.length)
        tokens, dists = [], []
        for step in range(steps):
            if step == 0:
                if temperature == 0:
                    token = torch.topk(first, rows).indices  # K distinct greedy branches
                    dist = None
                else:
                    dist = warp(first, temperature).expand(rows, -1)
                    token = torch.multinomial(dist, 1, replacement=True, generator=generator)[:, 0]
                self.cache.fan_out()
            else:
                logits = self.cache.step(tokens[-1], len(seq) + step - 1)
                if temperature == 0:
                    token, dist = logits.argmax(-1), None
                else:
                    dist = warp(logits, temperature)
                    token = torch.multinomial(dist, 1, generator=generator)[:, 0]
            tokens.append(token)
            dists.append(dist)
        self.length = len(seq) + steps - 1
        if temperature != 0:  # one transfer per round: verification runs on the host (see generate)
            dists = list(torch.stack([d.expand(rows, -1) for d in dists]).cpu().unbind(0))
        return torch.stack(tokens, 1).tolist(), dists

    def keep(self, row: int, seq_before: int, matched: int, steps: int) -> None:
        """Keep cache row ``row`` up to the committed tokens it holds."""
        self.length = seq_before + min(matched, steps - 1)
        self.cache.keep(row, seq_before, self.length)


def _generator_on(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """``generator`` if it lives on ``device``'s type, else one there seeded from it (reproducible runs).

    Drafts sample on the models' device, where ``torch.multinomial`` refuses a generator of another
    device (the CLI and the recipe's distill step seed a CPU one); verification coins are drawn on the host.
    """
    if generator is None or generator.device.type == device.type:
        return generator
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
    return torch.Generator(device=device).manual_seed(seed)


def _matched(tokens: list[int], committed: list[int]) -> int:
    n = 0
    while n < min(len(tokens), len(committed)) and tokens[n] == committed[n]:
        n += 1
    return n


@torch.no_grad()
def generate(
    target,
    drafts_or_draft,
    input_ids: torch.Tensor,
    num_drafts: int | None = None,
    draft_len: int = 4,
    scheme: str | None = None,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
    draft_temperature: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    top_s: int = 5,
    engine: bool = False,
    keep_going: Callable[[SpeculativeStats], bool] | None = None,
) -> SpeculativeOutput:
    """Exact speculative sampling from ``target`` with one or several drafts (batch 1).

    Args:
        target: a transformers causal LM (its cache must be a ``DynamicCache``).
        drafts_or_draft: one draft model (its K drafts are i.i.d. samples), or a
            list of K draft models (one draft each; only ``"specinfer"``).
        input_ids: prompt, ``[1, n]``.
        num_drafts: K; defaults to the number of draft models.
        draft_len: tokens per draft (gamma).
        scheme: ``"sd"``, ``"specinfer"``, ``"spectr"`` or ``"importance"``;
            defaults to ``"sd"`` for K = 1 and ``"specinfer"`` otherwise.
        temperature: target sampling temperature; 0 gives the target's greedy decode.
        max_new_tokens: tokens to generate.
        draft_temperature: drafts' temperature (defaults to ``temperature``);
            verification uses the exact distribution each draft sampled from.
        eos_token_id: stop after this token.
        generator: optional ``torch.Generator`` on the target's device.
        top_s: tokens in the truncated K = 2 optimal selection (``"importance"``).
        engine: keep the target's and the drafts' KV caches in static
            :class:`~neutrain.decode.engine.DecodeEngine` caches (models with
            full-attention layers) instead of growing ``DynamicCache`` s.
        keep_going: called with the stats after each round; False ends the
            rounds there (``stopped`` in the output), with every committed token
            kept: e.g. :class:`~neutrain.speculative.payoff.Probe`, which stops a
            draft that does not pay, so the caller decodes the rest without it.

    Returns:
        :class:`SpeculativeOutput` with ``sequences`` (prompt + new tokens) and stats.

    Example:
        >>> out = generate(target, draft, prompt, num_drafts=2, draft_len=4,
        ...                scheme="importance", max_new_tokens=64)  # doctest: +SKIP
        >>> out.stats.block_efficiency  # doctest: +SKIP
    """
    models = list(drafts_or_draft) if isinstance(drafts_or_draft, (list, tuple)) else [drafts_or_draft]
    k_drafts = num_drafts if num_drafts is not None else len(models)
    scheme = scheme or ("sd" if k_drafts == 1 else "specinfer")
    if len(models) > 1 and len(models) != k_drafts:
        raise ValueError(f"{len(models)} draft models given for num_drafts={k_drafts}")
    if len(models) > 1 and scheme in ("spectr", "importance"):
        raise ValueError(f"scheme {scheme!r} assumes identical drafts; several draft models need 'specinfer'")
    if scheme == "sd" and k_drafts != 1:
        raise ValueError("scheme 'sd' is single-draft; use num_drafts=1")
    if input_ids.shape[0] != 1:
        raise ValueError("speculative generate decodes one sequence at a time (batch 1)")
    draft_temperature = temperature if draft_temperature is None else draft_temperature
    if (temperature == 0) != (draft_temperature == 0):
        raise ValueError("temperature 0 (greedy) needs greedy drafts too")

    if engine:
        return _generate_on_engines(target, models, input_ids, k_drafts, draft_len, scheme, temperature,
                                    draft_temperature, max_new_tokens, eos_token_id, generator, top_s, keep_going)
    device = model_device(target)
    seq = input_ids[0].tolist()
    prompt_len = len(seq)
    stats = SpeculativeStats()
    rows = k_drafts if len(models) == 1 else 1  # cache rows of each draft model
    target_cache = DynamicTarget(target)
    states = [_DraftState(DynamicDraft(m, rows)) for m in models]
    target_cache.prefill(seq[:-1])  # the target cache holds all committed tokens but the last
    # Verification is a chain of small, data-dependent steps; on the host they cost
    # microseconds each, where on a GPU every step would be a launch plus a sync.
    host_generator = _generator_on(generator, torch.device("cpu"))
    generator = _generator_on(generator, torch.device(device))
    stopped = False

    while not stopped and not _finished(seq, prompt_len, max_new_tokens, eos_token_id):
        n = len(seq)
        drafts, dists = [], []  # drafts[k] = token list; dists[k][t] = q row draft k sampled token t from
        for state in states:
            tokens, q = state.propose(seq, rows, draft_len, draft_temperature, generator)
            stats.draft_calls += draft_len
            for r in range(rows):
                drafts.append(tokens[r])
                dists.append([None if d is None else d[r] for d in q])
        tree = TokenTree(seq[-1])
        paths = [tree.add_path(d) for d in drafts]
        past = n - 1
        logits = target_cache.verify(tree, past)
        if temperature == 0:
            rows_of = logits.argmax(-1).tolist()
        else:
            p_rows = warp(logits, temperature).cpu()
            rows_of = p_rows.__getitem__
        result = walk(scheme, drafts, paths, rows_of, lambda k, depth, d=dists: d[k][depth], len(states) == 1,
                      host_generator, top_s)
        committed = _count(stats, result, eos_token_id)
        target_cache.keep(past, result.accepted_nodes)
        for i, state in enumerate(states):
            candidates = range(len(drafts)) if len(states) == 1 else [i]
            matched = {r: _matched(drafts[r], result.committed) for r in candidates}
            best = max(matched, key=matched.get)
            state.keep(best if len(states) == 1 else 0, n, matched[best], draft_len)
        seq.extend(committed)
        stopped = keep_going is not None and not keep_going(stats)
    seq = seq[: prompt_len + max_new_tokens]
    return SpeculativeOutput(torch.tensor(seq, device=input_ids.device)[None], stats,
                             stopped and not _finished(seq, prompt_len, max_new_tokens, eos_token_id))


def _law(logits: torch.Tensor, temperature: float):
    """``law(*index)`` = float64 ``softmax(logits[index] / T)``, computed only for the rows a walk reaches."""
    return lambda *index: warp(logits[index], temperature)


def _finished(seq: list[int], prompt_len: int, max_new_tokens: int, eos_token_id: int | None) -> bool:
    ended = eos_token_id is not None and len(seq) > prompt_len and seq[-1] == eos_token_id
    return ended or len(seq) - prompt_len >= max_new_tokens


def _count(stats: SpeculativeStats, result: WalkResult, eos_token_id: int | None) -> list[int]:
    """Add a round to ``stats``; returns its committed tokens up to and with the first EOS."""
    stats.target_calls += 1
    stats.verified_positions += result.verified
    stats.accepted_positions += result.accepted
    committed = result.committed
    if eos_token_id is not None and eos_token_id in committed:
        committed = committed[: committed.index(eos_token_id) + 1]
    stats.committed_tokens += len(committed)
    return committed


#: The last :class:`EngineRounds` built for each target model: its static caches and captured graphs
#: serve the next call with the same drafts, K, draft_len and enough room (captures cost a warm-up each).
_ROUNDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rounds_for(target, models: list, k_drafts: int, draft_len: int, room: int) -> EngineRounds:
    rounds = _ROUNDS.get(target)
    same = rounds is not None and (rounds.k, rounds.dl, len(rounds.drafts)) == (k_drafts, draft_len, len(models))
    if not (same and rounds.room >= room and all(e.model is m for e, m in zip(rounds.drafts, models))):
        _ROUNDS.pop(target, None)  # free the old caches before allocating new ones
        rounds = _ROUNDS[target] = EngineRounds(target, models, k_drafts, draft_len, room)
    return rounds


def _generate_on_engines(target, models, input_ids, k_drafts, draft_len, scheme, temperature, draft_temperature,
                         max_new_tokens, eos_token_id, generator, top_s, keep_going=None) -> SpeculativeOutput:
    """``generate(..., engine=True)``: device-resident rounds, one host synchronisation each.

    At T = 0, and for SpecTr and importance sampling, the draft and verify laws come to the host as
    fp32 logits (argmaxes at T = 0) and are turned into float64 ``softmax(logits / T)`` only for the
    nodes the walk reaches: exactly the laws the device sampled from. SD and SpecInfer at T > 0 walk on
    the device (:mod:`neutrain.speculative.device_walk`) and fetch only the outcome.
    """
    prompt_len = input_ids.shape[1]
    rounds = _rounds_for(target, models, k_drafts, draft_len,
                         rounds_room(prompt_len, max_new_tokens, k_drafts, draft_len))
    host_generator = _generator_on(generator, torch.device("cpu"))
    seed = int(torch.randint(0, 2**62, (1,), generator=host_generator))  # the drafts' device generators
    on_device = temperature > 0 and scheme in DEVICE_SCHEMES  # SD/SpecInfer: the walk in the round's graph
    rounds.start(input_ids, temperature, draft_temperature, seed, walk_on_device=on_device)
    paths = [[1 + k * draft_len + depth for depth in range(draft_len)] for k in range(k_drafts)]
    stats, made, ended, stopped = SpeculativeStats(), 0, False, False
    while made < max_new_tokens and not ended and not stopped:
        if on_device:
            walked = rounds.run_walk()
            count, chain, verified, accepted = walked[draft_len + 1 :]
            result = WalkResult(walked[:count], [], chain, verified, accepted)
        else:
            tokens, target_out, draft_out = rounds.run()
            if temperature == 0:
                rows_of, q_row = target_out.tolist(), None
            else:
                rows_of, q_row = _law(target_out, temperature), _law(draft_out, draft_temperature)
            result = walk(scheme, tokens.tolist(), paths, rows_of, q_row, len(models) == 1, host_generator, top_s)
            rounds.commit(result.chain, len(result.committed) - 1, result.committed[-1])
        stats.draft_calls += draft_len * len(models)
        committed = _count(stats, result, eos_token_id)
        made, ended = made + len(committed), eos_token_id is not None and committed[-1] == eos_token_id
        stopped = keep_going is not None and not keep_going(stats)
    out = rounds.finish(prompt_len + min(made, max_new_tokens))
    return SpeculativeOutput(out.to(input_ids.device), stats, stopped and not ended and made < max_new_tokens)
