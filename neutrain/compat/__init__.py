"""Every place where torch, transformers, accelerate, peft or DeepSpeed versions differ or a private API is touched.

neutrain supports the GPU image's transformers 5.17 / torch 2.11 and the newest
5.x / torch on PyPI. Library code never branches on versions and never reaches
into another library's internals itself; it calls a named adapter here, and each
adapter has a test in ``tests/unit/compat/`` that fails first when a release moves.
Each adapter says which releases need it and when it can go.

One module per upstream library, and a module of its own where a topic is large:

* transformers: :mod:`neutrain.compat.transformers_api` (the trainer's checkpoint rotation and
  checkpointing keywords, the multi-GPU ``DataParallel`` switch, the KV-cache API and its surgery,
  attention registration, checkpoint key conversions, GGUF loading);
  :mod:`neutrain.compat.trainer_hooks` (``TrainingArguments`` drift and the
  ``Trainer._get_output_dir`` seam); :mod:`neutrain.compat.static_cache` (``StaticCache``'s
  device-side length and CUDA-graph RNG, for the decode engine); :mod:`neutrain.compat.masks`
  (the packed-sequence probe); :mod:`neutrain.compat.gguf_tensors` (a GGUF file's tensors one at
  a time); :mod:`neutrain.compat.gguf_reader` (transformers' and gguf's GGUF readers answered from
  one parsed header); :mod:`neutrain.compat.quiet` (progress bars and a peft warning);
  :mod:`neutrain.compat.chat_templates` (the chat-template sandbox, private, which neutrain bounds
  before data is rendered with a template);
* torch: :mod:`neutrain.compat.torch_api` (the private SDPA backward ops,
  the saved-tensor hooks in force); :mod:`neutrain.compat.autograd` ("is a backward running?");
  :mod:`neutrain.compat.cpu_features` (native bf16 on a CPU); :mod:`neutrain.compat.elastic` (torch elastic's
  launcher after a refusal: its error files and its ``ChildFailedError``);
* accelerate: :mod:`neutrain.compat.accelerate_prepare` (model preparation without DDP);
* peft: :mod:`neutrain.compat.peft_lora` (the custom LoRA layer registry);
* DeepSpeed: :mod:`neutrain.compat.deepspeed_env` (its accelerator detection on a CPU machine);
* safetensors: :mod:`neutrain.compat.file_modes` (0.8's ``0o600`` files given the umask's mode);
* tokenizers: :mod:`neutrain.compat.native_panics` (a Rust panic, such as a regex past its backtracking
  limit, as one line instead of pyo3's ``PanicException`` and the panic hook's printout).

The adapters of ``transformers_api`` and ``torch_api`` are also importable from this package
(``from neutrain.compat import cache_forward_kwarg``), as callers have always imported them.

Example:
    >>> from neutrain.compat import cache_forward_kwarg
    >>> from neutrain.compat.transformers_api import cache_forward_kwarg as same
    >>> cache_forward_kwarg is same
    True
"""

from __future__ import annotations

from neutrain.compat.torch_api import (
    SDPA_BACKWARD_ROUTES,
    saved_tensor_hooks_active,
    sdpa_backward,
)
from neutrain.compat.transformers_api import (
    cache_batch_size,
    cache_crop_to,
    cache_forward_kwarg,
    cache_from_module_kwargs,
    cache_keep_positions,
    cache_repeat_rows,
    cache_select_row,
    checkpointing_training_args,
    gguf_dequantized_kwargs,
    gguf_special_tokens,
    natural_key_order,
    output_cache,
    register_attention_with_sdpa_mask,
    rename_checkpoint_key,
    rotate_checkpoints,
    sdpa_attention,
    set_attn_implementation,
    use_one_gpu_per_process,
    weight_conversions,
)

__all__ = [
    "SDPA_BACKWARD_ROUTES",
    "cache_batch_size",
    "cache_crop_to",
    "cache_forward_kwarg",
    "cache_from_module_kwargs",
    "cache_keep_positions",
    "cache_repeat_rows",
    "cache_select_row",
    "checkpointing_training_args",
    "gguf_dequantized_kwargs",
    "gguf_special_tokens",
    "natural_key_order",
    "output_cache",
    "register_attention_with_sdpa_mask",
    "rename_checkpoint_key",
    "rotate_checkpoints",
    "saved_tensor_hooks_active",
    "sdpa_attention",
    "sdpa_backward",
    "set_attn_implementation",
    "use_one_gpu_per_process",
    "weight_conversions",
]
