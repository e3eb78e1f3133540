"""Pipelined inference: generation with a KV cache on every stage, groups of sequences in
flight, decode schedules as Programs.

    decoder = DecodePipeline(model, balance=[3, 3])           # every rank; or pipe.generate(...)
    tokens = decoder.generate(input_ids, max_new_tokens=32, do_sample=True, seed=0)
    tokens = generate(model, input_ids, max_new_tokens=32)     # unsplit, on one process

Modules: ``lm`` (a model as units with KV caches), ``gpt`` and ``hf`` (adapters: conveyor's
GPT, Hugging Face Llama and GPT-2), ``models`` (which adapter), ``cache`` (static KV caches),
``sampling``, ``prompts``, ``config`` (GenerationConfig), ``schedule`` (decode Programs),
``runtime`` (their interpreter) and ``pipeline`` (DecodePipeline, generate). Costing decode
for the simulator, and comparing parallelisms for one long request, is planning
(conveyor.planner.decode_cost, conveyor.planner.parallelism).
"""

from conveyor.inference.config import GenerationConfig
from conveyor.inference.lm import CausalLM, Context
from conveyor.inference.models import as_causal_lm
from conveyor.inference.pipeline import DecodePipeline, GenerationStats, generate
from conveyor.inference.schedule import Item, decode_items, decode_program

__all__ = [
    "CausalLM",
    "Context",
    "DecodePipeline",
    "GenerationConfig",
    "GenerationStats",
    "Item",
    "as_causal_lm",
    "decode_items",
    "decode_program",
    "generate",
]
