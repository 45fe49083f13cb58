"""Prompt tokenization that reuses a recent prompt's tokens for the text they share.

Clients resend long prompts with a new end: a system prompt with another question, tool
definitions, a conversation one turn longer. The engine finds those tokens in its prefix
index, but the handler tokenized every character again on the event loop, about a millisecond
per 1,000 tokens (BENCHMARKS.md), while the requests behind it waited. ``PromptTokenizer``
keeps the last prompts' tokens and tokenizes a new prompt only from a word boundary shortly
before its text departs from one of them.

Why the tokens equal the whole text's: a Hugging Face fast tokenizer splits the text at its
added tokens, splits each piece into words with regular expressions matched left to right,
and runs BPE inside each word. Each match depends only on the text from where it starts to
one character past its end, so the words that end well before two texts part are the same
in both, and the word after them starts at the same place in both. Reuse is on only for
tokenizers built that way (``reusable``); each reuse also checks that the shared text after
the cut tokenizes as it did before, and a prompt that fails it is tokenized whole.
"""

from __future__ import annotations

import bisect
import json
import unicodedata
from dataclasses import dataclass

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import Encoding

#: Shared characters after a cut that must tokenize as before for the cut to be used.
CHECKED_CHARS = 64
#: Tokens between the places a later prompt may cut a kept prompt's tokens: at most this many
#: of the tokens it shares are tokenized again.
CUT_SPACING = 64
#: Pre-tokenizers whose words depend on nothing before their start (with the checks below).
LOCAL_PRE_TOKENIZERS = {"Sequence", "Split", "Digits", "ByteLevel"}


@dataclass(frozen=True)
class PromptIds:
    """One prompt's tokens without the tokenizer's leading special tokens, and where a later
    prompt may cut them: word starts about every ``CUT_SPACING`` tokens, ``starts[c]`` the
    character and ``firsts[c]`` the token, both ascending."""

    text: str
    ids: list[int]
    starts: list[int]
    firsts: list[int]


class PromptTokenizer:
    """Tokenizes prompts as ``tokenizer.encode`` does, reusing recent prompts' tokens.

    Args:
        tokenizer: The served tokenizer.
        keep: Recent prompts kept (the most recently used first).

    Use it from one thread (the server's event loop).
    """

    def __init__(self, tokenizer: TokenizerWrapper, keep: int = 8):
        self.tokenizer = tokenizer
        self.keep = keep
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        spec = json.loads(backend.to_str()) if backend is not None else None
        #: The ``tokenizers.Tokenizer`` that reuse calls, or ``None``: every prompt is whole.
        self.backend = backend if spec is not None and reusable(spec) else None
        self._nfc = spec is not None and (spec.get("normalizer") or {}).get("type") == "NFC"
        added = spec.get("added_tokens", []) if spec is not None else []
        # Characters before the texts part that the check stays clear of: an added token or
        # a word there may come out otherwise in the new text, failing the check for nothing.
        self._margin = 2 + max((len(t["content"]) for t in added), default=0)
        self._lead: list[int] = []
        if self.backend is not None and not self._agrees([t["content"] for t in added[:1]]):
            self.backend = None
        self._recent: list[PromptIds] = []
        #: Prompts that reused tokens, and the tokens reused (for tests and benchmarks).
        self.hits = 0
        self.reused_tokens = 0

    @property
    def reuse(self) -> bool:
        """Whether this tokenizer's prompts can reuse tokens."""
        return self.backend is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, equal to ``tokenizer.encode(text, add_special_tokens=...)``."""
        if self.backend is None:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        prompt = self._reused(text) or self._whole(text)
        self._recent = [prompt, *(p for p in self._recent if p.text != text)][: self.keep]
        lead = self._lead if add_special_tokens else []
        return lead + prompt.ids

    def apply_chat_template(self, messages: list[dict], **kwargs) -> list[int]:
        """The tokens of ``tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)``:
        the rendered text through ``encode``, without added special tokens, as the tokenizer
        does itself."""
        text = None
        if self.backend is not None and not kwargs.get("sanitize_control_tokens"):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        if isinstance(text, str):
            return self.encode(text, add_special_tokens=False)
        tokens = self.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        if isinstance(tokens, dict):  # some tokenizers return a BatchEncoding
            tokens = tokens["input_ids"]
        return list(tokens)

    # ---- internals ----------------------------------------------------------

    def _whole(self, text: str) -> PromptIds:
        return self._tokenize(text)[0]

    def _tokenize(self, text: str) -> tuple[PromptIds, Encoding]:
        """``text``'s tokens and cut places, and the backend's encoding of it."""
        enc = self.backend.encode(text, add_special_tokens=False)
        starts, firsts = [], []
        for t in range(CUT_SPACING, len(enc.ids), CUT_SPACING):
            first = _word_start(enc, t)
            if first and (not firsts or first > firsts[-1]):
                starts.append(enc.token_to_chars(first)[0])
                firsts.append(first)
        return PromptIds(text, enc.ids, starts, firsts), enc

    def _reused(self, text: str) -> PromptIds | None:
        """``text``'s tokens from the recent prompt it shares most with, or ``None``."""
        best, shared = None, 0
        for prompt in self._recent:
            n = shared_length(prompt.text, text)
            if n > shared:
                best, shared = prompt, n
        if best is None:
            return None
        if shared == len(text) == len(best.text):
            self._count(len(best.ids))
            return best
        limit = shared - self._margin  # the check ends before here
        c = bisect.bisect_right(best.starts, limit - CHECKED_CHARS) - 1
        if c < 0:
            return None
        cut, first = best.starts[c], best.firsts[c]
        if self._nfc and not nfc_cut(text, cut):
            return None
        tail, enc = self._tokenize(text[cut:])
        # The shared text after the cut, up to the word holding character ``limit``, must
        # tokenize as it did in ``best``.
        word = enc.char_to_word(limit - cut)
        m = enc.word_to_tokens(word)[0] if word is not None else 0
        if m == 0 or tail.ids[:m] != best.ids[first : first + m]:
            return None
        self._count(first)
        return PromptIds(
            text,
            best.ids[:first] + tail.ids,
            best.starts[: c + 1] + [cut + s for s in tail.starts],
            best.firsts[: c + 1] + [first + f for f in tail.firsts],
        )

    def _count(self, reused: int) -> None:
        self.hits += 1
        self.reused_tokens += reused

    def _agrees(self, added: list[str]) -> bool:
        """Whether ``tokenizer.encode`` gives the backend's tokens after the same leading
        special tokens for every probe, ``added`` tokens' text among them (a tokenizer that
        splits them as text would differ), and set ``_lead`` to those."""
        leads = []
        for probe in ("Hello world, 123.", "a\n\n  b\tc", *(f"x{t}y" for t in added)):
            plain = self.backend.encode(probe, add_special_tokens=False).ids
            full = list(self.tokenizer.encode(probe))
            leads.append(full[: len(full) - len(plain)])
            if full[len(leads[-1]) :] != plain:
                return False
            if list(self.tokenizer.encode(probe, add_special_tokens=False)) != plain:
                return False
        self._lead = leads[0]
        return all(lead == leads[0] for lead in leads)


def reusable(spec: dict) -> bool:
    """Whether a ``tokenizer.json`` describes a tokenizer whose words depend on nothing before
    them: no normalizer or NFC; ``Split`` (without lookbehind or anchors), ``Digits`` and
    ``ByteLevel`` (no prefix space) pre-tokenizers; BPE without dropout; added tokens that
    strip no whitespace and match anywhere."""
    normalizer = spec.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return False
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") is not None:
        return False
    for t in spec.get("added_tokens", []):
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return False
    pre = spec.get("pre_tokenizer")
    return pre is not None and _local(pre)


def _local(pre: dict) -> bool:
    kind = pre.get("type")
    if kind not in LOCAL_PRE_TOKENIZERS:
        return False
    if kind == "Sequence":
        return all(_local(p) for p in pre.get("pretokenizers", []))
    if kind == "ByteLevel":
        return not pre.get("add_prefix_space", False)
    if kind == "Split":
        pattern = pre.get("pattern", {})
        regex = pattern.get("Regex")
        if regex is None:
            return "String" in pattern
        anchors = ("(?<", "\\b", "\\B", "\\A", "\\G", "\\z", "\\Z", "$")
        return not any(a in regex for a in anchors) and "^" not in regex.replace("[^", "")
    return True


def shared_length(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (C-speed slice compares)."""
    hi = min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def nfc_cut(text: str, cut: int) -> bool:
    """Whether NFC normalizes ``text`` as its two sides of ``cut`` apart: the character
    there is a starter that does not compose with the one before it (nothing after a starter
    reorders or composes with anything before it)."""
    pair = text[cut - 1 : cut + 1]
    return unicodedata.combining(text[cut]) == 0 and unicodedata.normalize("NFC", pair) == pair


def _word_start(enc: Encoding, token: int) -> int | None:
    """The first token of the word holding ``token``, or ``None`` if it is in no word."""
    word = enc.token_to_word(token)
    if word is None:
        return None
    while token > 0 and enc.token_to_word(token - 1) == word:
        token -= 1
    return token
