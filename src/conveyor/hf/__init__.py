"""Everything conveyor knows of Hugging Face transformers' conventions, without importing it
where a model does not need it.

Modules: ``loss`` (a model's own loss: whether it shifts its labels, what it counts, what it
adds), ``weights`` (which file key fills which tensor, as ``from_pretrained`` reads it; how a
model initializes what its files lack), ``head`` (a causal LM's head and loss in vocabulary
chunks) and ``decode`` (generation adapters per family, their
KV caches and masks, and conveyor's attention in transformers' AttentionInterface).
"""

__all__: list[str] = []
