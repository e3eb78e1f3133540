"""Generation's machinery: a model as units with KV caches, decode schedules as Programs and
their runtime, under the DecodePipeline facade (conveyor.pipeline.decode).

    items = decode_items(num_groups=2, prompt_length=128, new_tokens=32)
    program = decode_program(chain(2), items)        # validated, simulated, traced like training

Modules: ``lm`` (what a decodable model provides: units, caches, replaceable attention),
``gpt`` (conveyor's GPT as one; Hugging Face families are in conveyor.hf.decode), ``cache``
(static KV caches), ``sampling``, ``prompts``, ``config`` (GenerationConfig), ``schedule``
(decode Programs), ``runtime`` (their handlers on the interpreter core), ``context``
(context parallelism: the KV cache split along the sequence over a cp group), ``cost``
(stages measured and fitted, decode Programs costed for the simulator) and ``groups`` (the
number of groups in flight a generation is predicted fastest with). Comparing parallelisms
for one long request is planning (conveyor.planner.parallelism).
"""

from conveyor.inference.config import GenerationConfig
from conveyor.inference.lm import CausalLM, Context
from conveyor.inference.schedule import Item, decode_items, decode_program

__all__ = [
    "CausalLM",
    "Context",
    "GenerationConfig",
    "Item",
    "decode_items",
    "decode_program",
]
