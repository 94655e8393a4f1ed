"""Chat fine-tuning data: templates, assistant-only labels, EOS, packing without leaks."""

import pytest
import torch

from neutrain.config.sections import DataSection
from neutrain.config import DataError, RecipeError
from neutrain.data import IGNORE_INDEX, Collator, byte_tokenizer, pack_rows
from neutrain.data.chat import NAMED_TEMPLATES, prompt_ids, set_chat_template
from neutrain.data.formats import tokenize_row

ENTRY = {"path": "x", "type": "messages", "ds_type": None, "split": "train", "text_field": "text",
         "prompt_field": "prompt", "completion_field": "completion", "messages_field": "messages", "max_files": None}
CFG = {"sequence_len": 256, "train_on_inputs": False, "roles_to_train": ["assistant"]}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]


def _row(tok, messages=CHAT, **cfg):
    (row,) = tokenize_row({"messages": messages}, tok, ENTRY, DataSection.model_construct(**{**CFG, **cfg}), "chat.jsonl", 0)
    return row


def _trained(tok, row) -> str:
    return tok.decode([t for t, lab in zip(row["input_ids"], row["labels"]) if lab != IGNORE_INDEX])


def test_only_the_reply_and_its_end_are_trained_not_the_header():
    tok = byte_tokenizer()  # its template closes every turn with <|eos|>
    row = _row(tok)
    assert _trained(tok, row) == "hello!<|eos|>"  # not "<|bos|>assistant\n": inference writes the header
    assert row["input_ids"][-1] == tok.eos_token_id and row["input_ids"].count(tok.eos_token_id) == 3  # no extra EOS
    assert _trained(tok, _row(tok, train_on_inputs=True)) == tok.decode(row["input_ids"])


def test_eos_is_appended_when_the_template_closes_turns_with_another_marker():
    tok = set_chat_template(byte_tokenizer(), "chatml")  # <|im_end|> is not this tokenizer's EOS
    row = _row(tok)
    assert row["input_ids"][-1] == tok.eos_token_id and row["labels"][-1] == tok.eos_token_id
    assert _trained(tok, row) == "hello!<|im_end|>\n<|eos|>"
    # A conversation cut at sequence_len gets no EOS (its reply did not end there).
    cut = _row(tok, sequence_len=30)
    assert cut["truncated"] and tok.eos_token_id not in cut["input_ids"]
    # Nor one that ends with a turn that is not trained.
    assert tok.eos_token_id not in _row(tok, CHAT[:2])["input_ids"]


def test_zephyr_template_ends_turns_with_eos_once():
    tok = set_chat_template(byte_tokenizer(), "zephyr")
    row = _row(tok)
    assert row["input_ids"].count(tok.eos_token_id) == 3
    assert _trained(tok, row) == "hello!<|eos|>\n"


def test_a_tokenizer_without_template_asks_for_data_chat_template():
    tok = byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match=r"chat\.jsonl: row 0: .*no.*set data\.chat_template \(e\.g\. chatml\)"):
        _row(tok)


def test_named_and_inline_templates_and_a_misspelt_name():
    tok = set_chat_template(byte_tokenizer(), "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert tok.apply_chat_template(CHAT, tokenize=False) == "be briefhihello!"
    assert set_chat_template(byte_tokenizer(), "chatml").chat_template == NAMED_TEMPLATES["chatml"]
    with pytest.raises(RecipeError, match=r"data\.chat_template: 'chat-ml' .* Did you mean 'chatml'\?"):
        set_chat_template(byte_tokenizer(), "chat-ml")


def test_generation_prompt_is_the_training_prefix():
    tok = set_chat_template(byte_tokenizer(), "chatml")
    row = _row(tok, CHAT[1:])
    first_trained = next(i for i, lab in enumerate(row["labels"]) if lab != IGNORE_INDEX)
    assert prompt_ids(tok, "hi") == row["input_ids"][:first_trained]


@pytest.mark.parametrize("attn,chunk", [("sdpa", 0), ("eager", 0), ("sdpa", 8)])
def test_packed_documents_train_as_if_alone(tmp_path, attn, chunk):
    """The training loss of packed rows is the loss of each document alone: no document sees another.

    transformers separates packed documents by their restarting position ids only when no KV cache
    is built; the Trainer sets ``config.use_cache = False`` (TrainingArguments.use_cache), without
    which each document would attend to the ones before it in its row.
    """
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from neutrain.trainer.trainer import NeuTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attn)
    model = LlamaForCausalLM(config).train()  # as in training: use_cache defaults to True
    docs = [torch.randint(1, 64, (n,)).tolist() for n in (5, 7, 3, 9, 4)]
    packed = list(pack_rows(({"input_ids": d, "labels": d} for d in docs), 16, pad_token_id=0))
    batch = Collator(pad_token_id=0)(packed)
    assert "attention_mask" not in batch and len(packed) == 2
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2)
    trainer = NeuTrainer(model=model, args=args, memory={"loss_chunk_size": chunk})
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        alone = torch.cat([F.cross_entropy(model(torch.tensor([d])).logits[0, :-1], torch.tensor(d[1:]), reduction="none")
                           for d in docs])
    torch.testing.assert_close(loss, alone.mean(), rtol=0, atol=1e-5)
