"""DistillationTrainer on CPU: the draft moves toward the target and alpha is reported."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

from neutrain.distill.trainer import DistillationTrainer
from neutrain.distill.losses import acceptance_rate


def tiny(seed, hidden, layers):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(cfg)


def rows(n, length, seed):
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, 32, (length,), generator=gen).tolist(),
             "labels": torch.randint(0, 32, (length,), generator=gen).tolist()} for _ in range(n)]


def collate(batch):
    return {k: torch.tensor([r[k] for r in batch]) for k in batch[0]}


@pytest.mark.slow
def test_distillation_raises_acceptance(tmp_path):
    target, draft = tiny(0, 64, 2).eval(), tiny(1, 32, 1)
    with torch.no_grad():  # a peaked target, so that a random draft starts far from it
        target.lm_head.weight.mul_(30.0)
    train, held = rows(32, 16, 0), rows(8, 16, 1)
    held_batches = [collate(held)]
    before = acceptance_rate(target, draft.eval(), held_batches)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=24, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        learning_rate=2e-2, lr_scheduler_type="constant", report_to=[], save_strategy="no", logging_steps=8,
        use_cpu=True, remove_unused_columns=False, dataloader_num_workers=0,
    )
    trainer = DistillationTrainer(
        model=draft, teacher_model=target, divergence="tvd", on_policy_every=3, on_policy_tokens=6,
        args=args, train_dataset=train, eval_dataset=held, data_collator=collate,
    )
    trainer.train()
    metrics = trainer.evaluate()
    after = acceptance_rate(target, draft.eval(), held_batches)
    assert trainer.on_policy_batches == 8  # every third of 24 steps was draft-sampled
    assert after > before + 0.1, (before, after)
    # eval_acceptance counts positions whose next label is trained (all but the last) -> same as alpha there.
    mask = torch.ones(8, 16)
    mask[:, -1] = 0
    expected = acceptance_rate(target, draft, [{"input_ids": held_batches[0]["input_ids"], "attention_mask": mask.long()}])
    assert abs(metrics["eval_acceptance"] - expected) < 1e-4
