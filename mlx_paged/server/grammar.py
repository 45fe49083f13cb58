"""Structured output: JSON schemas compiled by llguidance into per-request token masks.

llguidance (Microsoft's grammar engine, also behind vLLM's and SGLang's
structured output) compiles a schema lazily and computes each step's mask in
tens of microseconds; it depends on nothing else. A ``Grammars`` wraps it over
one tokenizer; ``compile`` checks a schema and returns a factory of
``GrammarConstraint``s, one per generation, which the engine applies as a
token mask inside the batched decode.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par
from mlx_lm.tokenizer_utils import TokenizerWrapper

logger = logging.getLogger("mlx_paged.server")

# JSON without free whitespace: a model cannot spin on blank space between tokens.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarConstraint:
    """One generation's grammar state: the engine's ``TokenConstraint``."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill(self, row: Any) -> None:
        """Write the allowed next tokens into ``row`` (int32 words, one bit per token)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; ``False`` if the grammar forbids it."""
        return self.matcher.consume_token(token)

    @staticmethod
    def fill_many(constraints: list[GrammarConstraint], rows: np.ndarray) -> None:
        """Fill row ``i`` of ``rows`` for ``constraints[i]``, in parallel on llguidance's
        own threads."""
        global _EXECUTOR
        if _EXECUTOR is None:
            _EXECUTOR = llguidance.LLExecutor()
        matchers = [(c.matcher, i) for i, c in enumerate(constraints)]
        fill_next_token_bitmask_par(_EXECUTOR, matchers, rows)


_EXECUTOR: llguidance.LLExecutor | None = None  # made on first use: it starts threads


class Grammars:
    """llguidance over one tokenizer and the model's vocabulary.

    Args:
        tokenizer: The served tokenizer (a Hugging Face fast tokenizer inside).
        vocab_size: Columns of the model's logits (often more than the tokenizer has).

    ``error`` says why structured output is unavailable (a slow tokenizer llguidance
    cannot read), or is ``None``.
    """

    def __init__(self, tokenizer: TokenizerWrapper, vocab_size: int):
        self.error: str | None = None
        self.tokenizer: llguidance.LLTokenizer | None = None
        try:
            # The token a finished grammar allows: the tokenizer's own end token where it
            # is one of the ids that stop generation.
            eos = tokenizer.eos_token_id
            if eos not in tokenizer.eos_token_ids:
                eos = sorted(tokenizer.eos_token_ids)[0]
            self.tokenizer = llguidance.hf.from_tokenizer(
                tokenizer._tokenizer, n_vocab=vocab_size, eos_token=eos
            )
        except Exception as e:  # the server still serves everything else
            self.error = f"the grammar engine cannot read this tokenizer: {e}"
            logger.warning("mlx_paged: structured output is off: %s", self.error)

    def compile(self, schema: dict[str, Any]) -> Callable[[], GrammarConstraint]:
        """Check a JSON schema; return a factory of constraints that enforce it.

        Raises:
            ValueError: the grammar engine's message for a schema it rejects, or
                why structured output is unavailable.
        """
        if self.tokenizer is None:
            raise ValueError(self.error)
        schema = {**schema, "x-guidance": {**_COMPACT, **schema.get("x-guidance", {})}}
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        except Exception as e:  # llguidance's own message: the schema is not JSON-able
            raise ValueError(f"invalid schema: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(f"invalid schema: {error}")

        def make() -> GrammarConstraint:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if matcher.is_error():
                raise ValueError(f"invalid schema: {matcher.get_error()}")
            return GrammarConstraint(matcher)

        return make


def json_object_schema() -> dict[str, Any]:
    """``response_format: {"type": "json_object"}``: any JSON object."""
    return {"type": "object"}


def tool_call_schema(
    tools: list[dict[str, Any]], name: str | None, parallel: bool = True
) -> dict[str, Any]:
    """What a forced call generates: the named function's arguments, or (``name`` is
    ``None``, ``tool_choice: "required"``) a non-empty list of ``{"name", "arguments"}``,
    of one call only unless ``parallel``."""
    params = {t["function"]["name"]: _parameters(t["function"]) for t in tools}
    if name is not None:
        return params[name]
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": n}, "arguments": p},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for n, p in params.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    return schema if parallel else {**schema, "maxItems": 1}


def parse_forced_calls(text: str, name: str | None) -> list[tuple[str, str]]:
    """``(name, arguments JSON)`` pairs from a forced call's text (``tool_call_schema``).

    Raises:
        ValueError: the text is not such JSON (generation was cut off).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if name is not None:
        return [(name, json.dumps(value, ensure_ascii=False))]
    return [(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in value]


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    # A function without parameters takes none: its arguments are {}.
    return params if params else {"type": "object", "properties": {}, "additionalProperties": False}
