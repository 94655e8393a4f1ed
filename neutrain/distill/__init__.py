"""Draft distillation: a small draft trained on a fine-tuned target's distributions, for speculative decoding.

* :mod:`neutrain.distill.losses` -- the token-level divergences and the acceptance rate a draft reaches;
* :mod:`neutrain.distill.trainer` -- :class:`~neutrain.distill.trainer.DistillationTrainer`, a ``NeuTrainer``
  whose loss is one of those divergences (so this package sits above the trainer);
* :mod:`neutrain.distill.draft` -- a recipe's ``distill`` section: the draft built, distilled, exported and
  checked with a speculative decode (``neutrain distill``, and ``neutrain train`` after its training).

Nothing is imported here: ``neutrain train`` and ``neutrain distill`` read :mod:`neutrain.distill.draft` before
torch is needed.
"""
