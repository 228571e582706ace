"""Make examples/tiny.safetensors, tiny.npz and tiny_orbax/: a small model in each format.

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

# The same small model in the other formats a newcomer may hold, each written by its
# own library: NumPy's np.savez, and Orbax (a Flax-style TrainState with an optax-like
# optimizer state, a step counter and a string).
np.savez(Path(__file__).with_name("tiny.npz"),
         **{k.replace(".", "/"): v for k, v in tensors.items() if v.dtype != bf16})
print(f"wrote {Path(__file__).with_name('tiny.npz')}")

import shutil  # noqa: E402

import orbax.checkpoint as ocp  # noqa: E402

params = {"dense": {"kernel": rng.standard_normal((hidden, 4)).astype(np.float32), "bias": np.zeros(4, np.float32)},
          "embed": rng.standard_normal((vocab, hidden)).astype(bf16)}
zeros = {"dense": {"kernel": np.zeros((hidden, 4), np.float32), "bias": np.zeros(4, np.float32)},
         "embed": np.zeros((vocab, hidden), bf16)}
state = {"step": 1000, "params": params, "opt_state": [{"count": np.asarray(1000, np.int32), "mu": zeros}],
         "config": {"name": "tiny"}}
orbax_dir = Path(__file__).with_name("tiny_orbax").absolute()
shutil.rmtree(orbax_dir, ignore_errors=True)
ocp.PyTreeCheckpointer().save(str(orbax_dir), state)
print(f"wrote {orbax_dir}")
