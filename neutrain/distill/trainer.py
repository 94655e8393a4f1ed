"""``DistillationTrainer``: train a small draft on a fine-tuned target's distributions.

DistillSpec (Zhou et al., arXiv 2310.08461) makes drafts that speculative
decoding accepts more often with two choices:

* the **divergence** between target ``p`` and draft ``q`` per token, picked
  per task (forward KL, reverse KL, TVD or JSD; :mod:`~neutrain.distill.losses`);
* **on-policy data**: part of the training sequences continue with tokens the
  draft sampled itself, because at decode time the target verifies the
  draft's own continuations, not the training text.

The trainer is a :class:`~neutrain.trainer.trainer.NeuTrainer`, so logging, plots and
atomic checkpoints are the same as for any neutrain run, and ``evaluate()``
adds the acceptance rate ``eval_acceptance`` = ``E[sum(min(p, q))]``.
"""

from __future__ import annotations

import torch

from neutrain.distill.losses import DIVERGENCES, token_acceptance, token_divergence
from neutrain.trainer import NeuTrainer

DIVERGENCE_NAMES = {"fkl": "forward KL", "rkl": "reverse KL", "tvd": "total variation", "jsd": "JSD"}


class DistillationTrainer(NeuTrainer):
    """Distil ``model`` (the draft) from ``teacher_model`` (the target).

    Args:
        *args: As for :class:`NeuTrainer` (``model`` is the draft).
        teacher_model: the target causal LM; frozen, moved to the draft's device.
        divergence: ``"fkl"``, ``"rkl"``, ``"tvd"`` or ``"jsd"``.
        temperature: both distributions are ``softmax(logits / temperature)``.
        jsd_beta: JSD mixing weight.
        on_policy_every: every n-th training step replaces the last
            ``on_policy_tokens`` tokens of each row by a sample from the draft
            (0 = never).
        on_policy_tokens: length of the draft-sampled tail.
        **kwargs: As for :class:`NeuTrainer`.

    Example:
        >>> trainer = DistillationTrainer(model=draft, teacher_model=target, divergence="jsd",
        ...                               args=TrainingArguments("out", max_steps=100),
        ...                               train_dataset=ds)  # doctest: +SKIP
        >>> trainer.train(); trainer.evaluate()["eval_acceptance"]  # doctest: +SKIP
    """

    progress_label = "distilling the draft"

    def __init__(
        self,
        *args,
        teacher_model,
        divergence: str = "fkl",
        temperature: float = 1.0,
        jsd_beta: float = 0.5,
        on_policy_every: int = 0,
        on_policy_tokens: int = 32,
        **kwargs,
    ):
        if divergence not in DIVERGENCES:
            raise ValueError(f"unknown divergence {divergence!r}; expected one of {DIVERGENCES}")
        # Before NeuTrainer builds its progress callback, which names the losses: the draft's loss is a
        # divergence from the target, printed beside the target's cross-entropy but not comparable with it.
        name = f"distillation loss ({DIVERGENCE_NAMES[divergence]} to the target)"
        self.loss_names = (name, f"held-out {name}")
        super().__init__(*args, **kwargs)
        self.teacher_model = teacher_model.eval().requires_grad_(False)
        self.divergence, self.temperature, self.jsd_beta = divergence, temperature, jsd_beta
        self.on_policy_every, self.on_policy_tokens = on_policy_every, on_policy_tokens
        self.on_policy_batches = 0  # how many batches were draft-sampled (tests read it)
        self._distill_calls = 0
        self._acceptance_sum = self._acceptance_count = 0.0

    def _on_policy(self, model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows whose last ``on_policy_tokens`` tokens are sampled from the draft; mask = those positions."""
        tail = min(self.on_policy_tokens, input_ids.shape[1] - 1)
        prefix = input_ids[:, : input_ids.shape[1] - tail]
        draft = self.accelerator.unwrap_model(model)
        with torch.no_grad():
            ids = draft.generate(
                prefix, do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0,
                max_new_tokens=tail, min_new_tokens=tail, pad_token_id=0, eos_token_id=None,
                attention_mask=torch.ones_like(prefix),  # packed rows hold no padding: say so, not guessed from id 0
            )
        mask = torch.zeros_like(ids)
        mask[:, prefix.shape[1] - 1 : -1] = 1  # distributions that predicted the sampled tokens
        self.on_policy_batches += 1
        return ids, mask

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        extra = {k: inputs[k] for k in ("attention_mask", "position_ids") if inputs.get(k) is not None}
        labels = inputs.get("labels")
        if labels is not None:
            # Position t predicts token t + 1: count it when that label is trained.
            mask = torch.zeros_like(labels)
            mask[:, :-1] = labels[:, 1:] != -100
        else:
            mask = extra.get("attention_mask", torch.ones_like(ids))
        if model.training and self.on_policy_every:
            self._distill_calls += 1
            if self._distill_calls % self.on_policy_every == 0:
                ids, mask = self._on_policy(model, ids)
                extra = {}
        teacher = self.teacher_model
        device = ids.device
        if next(teacher.parameters()).device != device:
            teacher.to(device)
        with torch.no_grad():
            p_logits = teacher(input_ids=ids, **extra).logits
        outputs = model(input_ids=ids, **extra)
        loss = token_divergence(p_logits, outputs.logits, self.divergence, mask, self.temperature, self.jsd_beta)
        if not model.training:  # evaluation: accumulate the acceptance rate alpha
            weight = float(mask.sum())
            self._acceptance_sum += float(token_acceptance(p_logits, outputs.logits, mask, self.temperature)) * weight
            self._acceptance_count += weight
        return (loss, outputs) if return_outputs else loss

    def evaluate(self, *args, **kwargs):
        """``Trainer.evaluate`` plus ``eval_acceptance``: mean ``sum(min(p, q))`` over held-out tokens."""
        self._acceptance_sum = self._acceptance_count = 0.0
        metrics = super().evaluate(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", "eval")
        if self._acceptance_count:
            metrics[f"{prefix}_acceptance"] = self._acceptance_sum / self._acceptance_count
            self.log({f"{prefix}_acceptance": metrics[f"{prefix}_acceptance"]})
        return metrics
