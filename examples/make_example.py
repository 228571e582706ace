"""Make examples/tiny.safetensors: a small transformer-like checkpoint.

Written with the reference library (safetensors.numpy), not with treecli, so
the example is also an independent test input. Deterministic: re-running it
gives the same bytes.

    python examples/make_example.py
"""

from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

rng = np.random.default_rng(0)
bf16 = ml_dtypes.bfloat16
vocab, hidden, layers = 64, 16, 3

tensors = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)).astype(bf16)}
for i in range(layers):
    p = f"model.layers.{i}."
    tensors[p + "self_attn.q_proj.weight"] = rng.standard_normal((hidden, hidden)).astype(bf16)
    tensors[p + "self_attn.k_proj.weight"] = rng.standard_normal((hidden, hidden)).astype(bf16)
    tensors[p + "mlp.up_proj.weight"] = rng.standard_normal((4 * hidden, hidden)).astype(np.float32)
    tensors[p + "mlp.down_proj.weight"] = rng.standard_normal((hidden, 4 * hidden)).astype(np.float32)
    tensors[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
tensors["model.norm.weight"] = np.ones(hidden, np.float32)
tensors["lm_head.weight"] = rng.standard_normal((vocab, hidden)).astype(np.float16)
tensors["step"] = np.asarray(1000, np.int64)

out = Path(__file__).with_name("tiny.safetensors")
save_file(tensors, str(out), metadata={"format": "np", "producer": "examples/make_example.py"})
print(f"wrote {out}")
