"""Structured outputs: grammars compiled with llguidance, one matcher per constrained sequence,
token bitmasks filled on the host once per step and applied to the logits on the device.

    compiler.py   GrammarCompiler: StructuredOutputsParams -> GrammarMatcher (compiled grammars cached)
    matcher.py    GrammarMatcher: the per-sequence parser state; fill_bitmasks for a step's rows
    bitmask.py    apply_bitmask_: packed int32 bitmask [R, ceil(V/32)] -> -inf on the masked logits
"""

from forkpoint.structured.bitmask import apply_bitmask_
from forkpoint.structured.compiler import GrammarCompiler
from forkpoint.structured.matcher import GrammarMatcher, fill_bitmasks

__all__ = ["GrammarCompiler", "GrammarMatcher", "apply_bitmask_", "fill_bitmasks"]
