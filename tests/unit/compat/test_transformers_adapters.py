"""The transformers adapter: what the Trainer's private settings neutrain depends on still mean."""

from transformers import TrainingArguments

from neutrain import compat


def test_one_gpu_per_process_turns_off_data_parallel(tmp_path):
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    assert args.n_gpu == 0 and not compat.use_one_gpu_per_process(args)
    args._n_gpu = 2  # what a single process on a 2-GPU host gets (Trainer would wrap in nn.DataParallel)
    assert args.n_gpu == 2
    assert compat.use_one_gpu_per_process(args)
    assert args.n_gpu == 1
    assert args.train_batch_size == args.per_device_train_batch_size  # no longer multiplied by the GPU count


def test_packed_sequence_probe_is_skipped_only_for_neutrains_own_contiguous_forward(monkeypatch):
    # transformers' probe reads a flag back from the device once per forward (a host sync on a GPU);
    # causal_lm_loss, which passes neither positions nor a mask, must not reach it. Anything else must.
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, masking_utils

    from neutrain.nn import causal_lm_loss

    calls = []

    def counting_probe(position_ids):
        calls.append(tuple(position_ids.shape))
        return None

    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", counting_probe)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=40)
    model = AutoModelForCausalLM.from_config(cfg)
    model.config.use_cache = False
    ids = torch.randint(0, 40, (2, 6))
    loss = causal_lm_loss(model, ids, ids)
    assert calls == []
    assert torch.allclose(loss, model(input_ids=ids, labels=ids).loss, atol=1e-6)
    assert calls == [(2, 6)]  # the plain forward still probes
    causal_lm_loss(model, ids, ids, position_ids=torch.arange(6)[None])
    assert len(calls) == 2  # positions given: they may be packed, so transformers decides


def test_template_environment_is_transformers_chat_template_sandbox_and_a_copy_of_it():
    """neutrain bounds chat templates in transformers' own environment (its filters, globals and tags)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from neutrain.compat.chat_templates import template_environment

    env = template_environment()
    assert isinstance(env, ImmutableSandboxedEnvironment)
    rendered = env.from_string("{% set ns = namespace(x=1) %}{% generation %}{{ [ns.x] | tojson }}{% endgeneration %}").render()
    assert rendered == "[1]"
    env.globals["range"] = None  # the copy is neutrain's to change; transformers' cached one is untouched
    assert _compile_jinja_template("").environment.globals["range"] is not None


def test_compiled_with_is_the_compiler_apply_chat_template_uses_inside_the_block_only():
    """neutrain renders rows under its bounds by handing transformers' rendering another compiler, for a block."""
    from neutrain.compat.chat_templates import compiled_with, template_environment
    from neutrain.data import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = "{{ messages[0]['content'] }}"
    seen = []

    def compile_template(template):
        seen.append(template)
        return template_environment().from_string("[" + template + "]")

    with compiled_with(compile_template):
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    assert seen == [tok.chat_template]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"
