# Diagnostic (device): which lm_head update of tests/unit/nn/test_row_blocks_gpu.py leaves the block path, and why.
import copy, torch
from transformers import AutoModelForCausalLM, LlamaConfig
from neutrain.nn import compress_model
from neutrain.nn.linear_cross_entropy import causal_lm_loss
from neutrain.optim import LOMO
from neutrain.compress import stream as kstream
vocab, hidden = 32768, 256
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=vocab, tie_word_embeddings=False)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
compress_model(model, progress=False)
ids = torch.randint(0, vocab, (2, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
lm = model.lm_head.compressed
ct = lm.ct
print("build coded", ct._coded_bits_at_build, "seen", ct._coded_seen, "rebuilds", ct.rebuilds, "steps", ct.steps)
orig_rb = type(lm).row_blocks
def rb(self, rows):
    r = orig_rb(self, rows)
    print("  row_blocks ->", None if r is None else "blocks", "seen", self.ct._coded_seen, "build", self.ct._coded_bits_at_build,
          "pending", self.ct.status.pending, "reader", getattr(self, "reader", None) is not None)
    return r
type(lm).row_blocks = rb
opt = LOMO(model.parameters(), lr=1e-4, clip_mode="per_tensor", max_grad_norm=1.0, chunk_numel=1 << 20).bind(model)
for step in range(4):
    opt.backward(causal_lm_loss(model, ids, ids, chunk_bytes=4 * ids.numel() * 4096)); opt.step()
    torch.cuda.synchronize()
    print("step", step, "rebuilds", lm.ct.rebuilds, "status", lm.ct.status.tensor.tolist(), "seen", lm.ct._coded_seen)
