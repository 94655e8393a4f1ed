"""Speculative rounds on :class:`DecodeEngine` caches with one host synchronisation per round.

Why a module of its own: on a GPU a small target's eager forward is bound by kernel launches
(milliseconds), while the engine's graph-replayed decode step is a fraction of that, so speculative
decoding only pays off when its round replays CUDA graphs too, and a graph needs fixed shapes and
no host value that changes from round to round. :class:`EngineRounds` therefore keeps every
round-to-round quantity on the device:

* ``seq`` holds the committed tokens at their positions, ``n`` their count, ``result`` the last
  walk's ``(chain, accepted, token)``;
* **surgery** (start of a round, from ``result``): the target keeps the accepted chain's nodes by
  moving a fixed ``draft_len`` columns (the ones past the accepted count are stale and lie past the
  cache length), the chain's tokens and the new token are written into ``seq``;
* **draft**: each draft cache re-reads a fixed, padded feed of ``draft_len + 1`` tokens from the
  previous round's start (the real ones are the 1 .. ``draft_len + 1`` newly committed tokens; the
  padding lies past them, so the causal mask hides it from them and the next writes overwrite it),
  then samples K chains: the K most likely first tokens at temperature 0, else K i.i.d. draws by the
  exponential race from the engine's seeded generator; the draft logits of every token are kept;
* **verify**: a FIXED layout of K independent chains (root + ``K * draft_len`` nodes, no prefix
  merging), so that the shapes depend only on ``(K, draft_len)``; the mask and positions come from
  ``n`` on the device. Two chains that share a prefix see the same context at equal depths, so the
  target gives them the same next-token law there, and the walk may read it at the first survivor's
  node: the walk is exactly the merged tree's walk;
* one **packed** tensor (draft tokens, then the target's argmax per node at T = 0, or the target's
  and the drafts' fp32 logits at T > 0) comes to the host in ONE copy inside
  :func:`~neutrain.decode.engine.allowed_sync` (:meth:`EngineRounds.fetch`);
* the host walk (:func:`neutrain.speculative.walk.walk`, exact, float64 laws computed from those
  logits for just the nodes it reaches) decides the round, and its three numbers go back through a
  pinned buffer with a ``non_blocking`` copy (no synchronisation), read by the next round's surgery;
* or, for SD and SpecInfer at T > 0 (``start(..., walk_on_device=True)``), the **walk runs on the
  device** inside the round (:mod:`neutrain.speculative.device_walk`): it writes ``result`` itself and
  the host fetches only the committed tokens and four counts (:meth:`EngineRounds.run_walk`).

On CUDA surgery + draft + verify (+ walk) + packing are one graph per mode (captured at the first
round after a warm-up on a side stream); on CPU the same body runs eagerly.
"""

from __future__ import annotations

import torch

from neutrain.compat.static_cache import (
    register_graph_generator,
    set_static_cache_length,
    static_cache_tensors,
)
from neutrain.decode.engine import (
    WARMUP_STEPS,
    DecodeEngine,
    allowed_sync,
    sample_tokens,
)
from neutrain.speculative.device_walk import device_walk


def _vocab(model) -> int:
    return int(model.config.get_text_config(decoder=True).vocab_size)


class EngineRounds:
    """The device state and the per-round work of ``generate(..., engine=True)`` (batch 1).

    Args:
        target: the target causal LM (full-attention layers).
        drafts: one draft model (K i.i.d. chains in a batch-K engine) or K draft models (one chain each).
        num_drafts: K.
        draft_len: tokens per chain.
        room: positions every cache and ``seq`` hold (:func:`rounds_room`).
        cuda_graph: replay one CUDA graph per round; default: on CUDA devices.

    Example:
        >>> rounds = EngineRounds(target, [draft], 2, 4, rounds_room(8, 64, 2, 4))  # doctest: +SKIP
        >>> rounds.start(prompt, 0.0, 0.0, seed=0)  # doctest: +SKIP
        >>> tokens, argmax_per_node, _ = rounds.run()  # doctest: +SKIP
    """

    def __init__(self, target, drafts: list, num_drafts: int, draft_len: int, room: int,
                 cuda_graph: bool | None = None):
        self.k, self.dl, self.room = int(num_drafts), int(draft_len), int(room)
        self.target = DecodeEngine(target, room, cuda_graph=False)
        rows = self.k if len(drafts) == 1 else 1
        self.drafts = [DecodeEngine(m, room, batch=rows, cuda_graph=False) for m in drafts]
        device = self.device = self.target.device
        self.use_graph = device.type == "cuda" if cuda_graph is None else bool(cuda_graph)
        self.vocab = _vocab(target)
        if any(_vocab(m) != self.vocab for m in drafts):
            raise ValueError("the drafts' vocabulary must be the target's")
        if self.vocab >= 2**24:  # token ids travel in the fp32 packed tensor
            raise ValueError(f"vocabularies of 2**24 tokens or more are not supported (got {self.vocab})")
        self.nodes = 1 + self.k * self.dl
        self.feed = self.dl + 1
        long = dict(dtype=torch.long, device=device)
        self.seq = torch.zeros(room, **long)
        self.n = torch.zeros((), **long)
        self.result = torch.zeros(3, **long)
        self.tokens = torch.zeros(self.k, self.dl, **long)
        self.draft_logits = torch.zeros(self.k, self.dl, self.vocab, dtype=torch.float32, device=device)
        self._span = torch.arange(max(self.feed, self.nodes), **long)
        self._columns = torch.arange(room, **long)
        # Node i of the verify block: the root (0) or chain (i-1)//dl at depth (i-1)%dl + 1.
        depth = torch.cat([torch.zeros(1, dtype=torch.long), torch.arange(self.dl).repeat(self.k) + 1])
        chain = torch.cat([torch.full((1,), -1), torch.arange(self.k).repeat_interleave(self.dl)])
        local = (chain[:, None] == chain[None, :]) & (depth[None, :] <= depth[:, None])
        local[:, 0] = True  # every node sees the root
        self._depths, self._local = depth.to(device), local.to(device)
        self._temperature = torch.ones((), dtype=torch.float64, device=device)
        self._draft_temperature = torch.ones((), dtype=torch.float64, device=device)
        pin = device.type == "cuda"
        self._result_host = torch.zeros(3, dtype=torch.long, pin_memory=pin)
        # Per mode (greedy, walk on the device): the packed buffers and the captured graph.
        self._packed: dict[tuple[bool, bool], torch.Tensor] = {}
        self._packed_host: dict[tuple[bool, bool], torch.Tensor] = {}
        self._graphs: dict[tuple[bool, bool], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.walk_generator = torch.Generator(device=device)  # the device walk's coins and draws
        self.greedy = True
        self.walk_on_device = False
        self.transfers = 0  # packed device->host copies, one per round

    # --- setup (once per generate call) ---

    @property
    def mode(self) -> tuple[bool, bool]:
        return self.greedy, self.walk_on_device

    @torch.no_grad()
    def start(self, input_ids: torch.Tensor, temperature: float, draft_temperature: float, seed: int,
              walk_on_device: bool = False) -> None:
        """Cache the prompt ``[1, n]`` (all but its last token) and reset the round state; no host read.

        ``walk_on_device`` (T > 0 only; the SD/SpecInfer walk, :mod:`neutrain.speculative.device_walk`):
        rounds are then read with :meth:`run_walk` instead of :meth:`run` and :meth:`commit`.
        """
        n = input_ids.shape[1]
        self.greedy = temperature == 0
        self.walk_on_device = bool(walk_on_device) and not self.greedy
        if not self.greedy:
            self._temperature.fill_(float(temperature))
            self._draft_temperature.fill_(float(draft_temperature))
        for i, engine in enumerate(self.drafts):
            engine.generator.manual_seed(seed + i)
        self.walk_generator.manual_seed(seed + len(self.drafts))
        if input_ids.device != self.device:  # a pageable host->device copy synchronises
            with allowed_sync():
                input_ids = input_ids.to(self.device)
        self.seq[:n].copy_(input_ids[0])
        for engine in (self.target, *self.drafts):
            engine.set_length(0)
            if n > 1:
                engine.forward(self.seq[: n - 1].view(1, -1).expand(engine.batch, -1), self._columns[: n - 1])
        # As if a round had started at n - 1 and committed only the prompt's last token: the
        # first surgery then leaves the prompt in place (chain 0, nothing accepted).
        self.n.fill_(n - 1)
        self.result.zero_()
        self.result[2:].copy_(self.seq[n - 1 : n])

    # --- the round body: surgery, draft, verify, pack (one CUDA graph per sampling mode) ---

    def _surgery(self) -> torch.Tensor:
        """Apply ``result`` to the target cache and ``seq``; returns the previous round's start ``n``."""
        chain, accepted, token = self.result[0], self.result[1], self.result[2]
        start = self.n.clone()
        dst = start + self._span[: self.dl]
        src = dst + chain * self.dl
        for keys, values in static_cache_tensors(self.target.cache):
            keys.index_copy_(2, dst, keys.index_select(2, src))
            values.index_copy_(2, dst, values.index_select(2, src))
        set_static_cache_length(self.target.cache, start + accepted)
        self.seq.index_copy_(0, dst, self.tokens.index_select(0, chain.view(1))[0])
        self.seq.index_copy_(0, (start + accepted).view(1), token.view(1))
        self.n.copy_(start + accepted + 1)
        return start

    def _draft(self, engine: DecodeEngine, rows: slice, before: torch.Tensor) -> None:
        """Feed the newly committed tokens (padded) and sample ``draft_len`` tokens per row of ``engine``."""
        batch = engine.batch
        set_static_cache_length(engine.cache, before)
        positions = before + self._span[: self.feed]
        logits = engine.forward(self.seq.index_select(0, positions).view(1, -1).expand(batch, -1), positions,
                                last_only=False)
        first = logits[0].index_select(0, (self.n - 1 - before).view(1)).float()  # [1, V]: after the last committed token
        set_static_cache_length(engine.cache, self.n)
        temperature = None if self.greedy else self._draft_temperature
        if self.greedy:
            token = torch.topk(first[0], batch).indices  # K distinct greedy branches
        else:
            token = sample_tokens(first.expand(batch, -1), temperature, engine.generator)
            self.draft_logits[rows, 0] = first
        self.tokens[rows, 0] = token
        for step in range(1, self.dl):
            logits = engine.forward(token.view(batch, 1), (self.n + step - 1).view(1))[:, -1].float()
            token = sample_tokens(logits, temperature, engine.generator)
            self.tokens[rows, step] = token
            if not self.greedy:
                self.draft_logits[rows, step] = logits

    def _verify(self) -> torch.Tensor:
        """The target's logits ``[nodes, V]`` of the root and every chain node, at columns ``n - 1 ..``."""
        root = self.n - 1
        ids = torch.cat([self.seq.index_select(0, root.view(1)), self.tokens.view(-1)]).view(1, -1)
        rel = self._columns - root  # column -> node of the block, when 0 <= rel < nodes
        inside = (rel >= 0) & (rel < self.nodes)
        allowed = (rel < 0) | (self._local.index_select(1, rel.clamp(0, self.nodes - 1)) & inside)
        logits = self.target.forward(ids, root + self._depths, last_only=False, blocked=~allowed)
        return logits[0].float()

    def _body(self) -> None:
        before = self._surgery()
        width = self.tokens.shape[0] // len(self.drafts)
        for i, engine in enumerate(self.drafts):
            self._draft(engine, slice(i * width, (i + 1) * width), before)
        logits = self._verify()
        if self.walk_on_device:
            parts = [self._walk(logits)]
        else:
            head = self.tokens.view(-1).float()
            tail = [logits.argmax(-1).float()] if self.greedy else [logits.view(-1), self.draft_logits.view(-1)]
            parts = [head, *tail]
        packed = self._packed.get(self.mode)
        if packed is None:  # first (eager or warm-up) run of this mode: static buffers for the copy
            packed = self._packed[self.mode] = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype,
                                                           device=self.device)
            self._packed_host[self.mode] = torch.empty(packed.shape, dtype=packed.dtype,
                                                       pin_memory=self.device.type == "cuda")
        torch.cat(parts, out=packed)

    def _walk(self, logits: torch.Tensor) -> torch.Tensor:
        """The device walk on this round's laws; writes ``result`` for the next surgery, returns the walk's vector."""
        p = torch.softmax(logits.double() / self._temperature, -1)
        q = torch.softmax(self.draft_logits.double() / self._draft_temperature, -1)
        walked = device_walk(p, q, self.tokens, len(self.drafts) == 1, self.walk_generator)
        count, chain = walked[self.dl + 1], walked[self.dl + 2]
        self.result.copy_(torch.stack([chain, count - 1, walked.index_select(0, (count - 1).view(1))[0]]))
        return walked

    def _capture(self) -> torch.cuda.CUDAGraph:
        """Capture :meth:`_body` for the current mode; the warm-ups leave the round state as it was."""
        start, result = self.n.clone(), self.result.clone()
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                self._body()
                self.n.copy_(start)
                self.result.copy_(result)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        for generator in [engine.generator for engine in self.drafts] + [self.walk_generator]:
            register_graph_generator(graph, generator)
        with torch.cuda.graph(graph, pool=self._pool):
            self._body()  # recorded, not run
        self._graphs[self.mode] = graph
        return graph

    # --- one round from the host's side ---

    @torch.no_grad()
    def launch(self) -> None:
        """Queue a round's device work (surgery, draft, verify, pack): a graph replay, or the eager body."""
        if not self.use_graph:
            self._body()
            return
        graph = self._graphs.get(self.mode)
        if graph is None:
            with allowed_sync():  # once per mode: capture synchronises the device
                graph = self._capture()
        graph.replay()

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`launch` a round and bring its packed tensor to the host (the round's one sync).

        Returns host tensors: draft tokens ``[K, draft_len]``, and at T = 0 the target's argmax per node
        ``[nodes]`` (and None); at T > 0 the target's logits ``[nodes, V]`` and the drafts' ``[K, draft_len, V]``.
        """
        self.launch()
        return self.unpack(self.fetch())

    def run_walk(self) -> list[int]:
        """:meth:`launch` a round whose walk runs on the device and fetch its outcome (the round's one sync):
        ``draft_len + 1`` committed-token slots, then ``count``, ``chain``, ``verified``, ``accepted``
        (:func:`~neutrain.speculative.device_walk.device_walk`). The next surgery reads ``result`` on the device.
        """
        if not self.walk_on_device:
            raise RuntimeError("run_walk needs start(..., walk_on_device=True) at a temperature above 0")
        self.launch()
        return self.fetch().tolist()

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Split :meth:`fetch`'s tensor into what :meth:`run` returns."""
        count, v = self.k * self.dl, self.vocab
        tokens = packed[:count].long().view(self.k, self.dl)
        if self.greedy:
            return tokens, packed[count:].long(), None
        target = packed[count : count + self.nodes * v].view(self.nodes, v)
        return tokens, target, packed[count + self.nodes * v :].view(self.k, self.dl, v)

    def fetch(self) -> torch.Tensor:
        """The one device->host transfer of a round: the packed tensor into its pinned host buffer."""
        packed, host = self._packed[self.mode], self._packed_host[self.mode]
        self.transfers += 1
        if self.device.type != "cuda":
            return packed
        with allowed_sync():
            host.copy_(packed, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        return host

    def commit(self, chain: int, accepted: int, token: int) -> None:
        """Hand the walk's outcome to the next surgery: a pinned buffer and a non-blocking copy (no sync).

        The previous copy from the pinned buffer has finished: the round's fetch came after it.
        """
        self._result_host[0], self._result_host[1], self._result_host[2] = chain, accepted, token
        self.result.copy_(self._result_host, non_blocking=True)

    @torch.no_grad()
    def finish(self, length: int) -> torch.Tensor:
        """Apply the last walk's result (eagerly, no host read) and return ``seq[:length]`` as ``[1, length]``."""
        self._surgery()
        return self.seq[:length].clone()[None]


def rounds_room(prompt_len: int, max_new_tokens: int, num_drafts: int, draft_len: int) -> int:
    """Positions a round's caches need: the sequence, one verify block and the draft's padded feed,
    rounded up to a multiple of 64 so that calls with slightly longer prompts reuse the kept rounds.

    Example:
        >>> rounds_room(8, 64, 2, 4)
        128
    """
    need = prompt_len + max_new_tokens + num_drafts * draft_len + 2 * draft_len + 4
    return -(-need // 64) * 64
