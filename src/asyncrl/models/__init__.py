"""Our own implementations of the model families we train and serve, shared by the trainer and the engine.

A family (`registry.py`) maps a Hugging Face `model_type` to one module here: how its config reads, which
router its mixture-of-experts layers use, and how its checkpoint layout maps to the tensors in memory. The
pieces every family is built from live once: `layers.py` (norms, rotary embeddings, attention, the dense
MLP), `moe.py` (routers, grouped experts, routing statistics), `expert_parallel.py` (tokens exchanged
between ranks that hold different experts), `transformer.py` (the decoder). `checkpoint.py` reads and writes
the Hugging Face layout unchanged, so what we publish loads in transformers and in vLLM.

Parameter names are transformers' in-memory names (`model.layers.0.mlp.experts.gate_up_proj`, ...), so a
transformers model's state dict loads into ours as it is, and tests compare the two tensor by tensor.
"""

from asyncrl.models.registry import FAMILIES, Family, family_of, native_problem

__all__ = ["FAMILIES", "Family", "family_of", "native_problem"]
