"""``PromptTokenizer``: prompts that reuse recent prompts' tokens tokenize exactly as whole."""

from __future__ import annotations

import json
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from mlx_paged.embedded import embedded_model_path
from mlx_paged.server.prompt_tokens import (
    CUT_SPACING,
    PromptTokenizer,
    nfc_cut,
    reusable,
    shared_length,
)

# Llama 3's word pattern (Qwen's differs only in single digits).
LLAMA3_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Pieces that meet at every kind of word boundary: spaces before words, runs of newlines and
# spaces, digits, contractions, accents composed and not (NFC joins "e" and U+0301, and the
# Hangul jamo), other scripts, emoji, and the tokenizers' added tokens.
PIECES = [
    "the", " cat", "  sat", " on", "the mat", ".", ",", "!?", "'s", "'ll", " 12", "3456",
    "7", " ", "  ", "\n", "\n\n", " \n", "\t", "é", "e", "\u0301", "café", "\u1100", "\u1161",
    "한국어", " 日本語", "😀", "—", "<|im_start|>", "<|im_end|>", "<|start|>", "<|end|>",
    "user", "system\n", "Question", ":", " Answer:",
]  # fmt: skip
texts = st.lists(st.sampled_from(PIECES), max_size=120).map("".join)


@cache
def smollm2() -> TokenizerWrapper:
    """The embedded SmolLM2's tokenizer: GPT-2's words, single digits, no normalizer."""
    return load_tokenizer(embedded_model_path(progress=False))


@cache
def llama3_like(trim_offsets: bool = False) -> TokenizerWrapper:
    """A small BPE with Llama 3's pre-tokenizer, an NFC normalizer and two special tokens;
    ``trim_offsets``: its offsets leave out the spaces that start words."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_WORDS), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the cat sat on the mat. Question: café 한국어 日本語 12345 it's"] * 50
    tok.train_from_iterator(corpus, trainer)
    if trim_offsets:
        tok.post_processor = processors.ByteLevel(trim_offsets=True)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|start|>")
    hf.chat_template = (
        "{% for m in messages %}<|start|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|start|>assistant\n{% endif %}"
    )
    return TokenizerWrapper(hf)


TOKENIZERS = {
    "smollm2": smollm2,
    "llama3_like": llama3_like,
    # Cuts at its offsets would drop a word's space: the check after each cut refuses them.
    "trimmed_offsets": lambda: llama3_like(trim_offsets=True),
}


@pytest.mark.parametrize("name", TOKENIZERS)
@settings(max_examples=60, deadline=None)
@given(base=texts, ends=st.lists(st.tuples(st.integers(0, 10_000), texts), min_size=1, max_size=6))
def test_prompts_sharing_beginnings_tokenize_as_whole(name, base, ends):
    tokenizer = TOKENIZERS[name]()
    prompts = PromptTokenizer(tokenizer, keep=3)
    assert prompts.reuse
    for at, end in ends:
        text = base[: at % (len(base) + 1)] + end
        for special in (True, False):
            want = list(tokenizer.encode(text, add_special_tokens=special))
            assert prompts.encode(text, add_special_tokens=special) == want


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_shared_system_prompt_is_tokenized_once(name):
    tokenizer = TOKENIZERS[name]()
    prompts = PromptTokenizer(tokenizer)
    system = " ".join(["the cat sat on the mat, café 한국어 12345."] * 40)
    texts = [f"{system}\nQuestion {i}: what did the cat do?\nAnswer:" for i in range(5)]
    shared = len(tokenizer.encode(system, add_special_tokens=False))
    for i, text in enumerate(texts):
        assert prompts.encode(text) == list(tokenizer.encode(text))
        assert prompts.hits == i
    # Each later prompt tokenized at most CUT_SPACING tokens, and the check's, of the system.
    assert prompts.reused_tokens >= 4 * (shared - CUT_SPACING - 40)
    # The same text again reuses all of it.
    before = prompts.reused_tokens
    assert prompts.encode(texts[-1]) == list(tokenizer.encode(texts[-1]))
    assert prompts.reused_tokens - before == len(tokenizer.encode(texts[-1])) - len(prompts._lead)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_growing_conversation_tokenizes_as_the_template_does(name):
    tokenizer = TOKENIZERS[name]()
    prompts = PromptTokenizer(tokenizer)
    messages = [{"role": "system", "content": "You are a cat. " * 60}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Turn {turn}: what now?  \n\n"})
        want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        got = prompts.apply_chat_template(messages, add_generation_prompt=True)
        assert got == list(want)
        messages.append({"role": "assistant", "content": "I sat on the mat, 12 times."})
    if name != "trimmed_offsets":  # whose cuts the check may refuse
        assert prompts.hits == 3


def test_tokenizers_whose_words_look_back_tokenize_whole():
    """A Metaspace pre-tokenizer marks the text's start, so a cut text would differ."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(["the cat sat on the mat"] * 20, trainers.BpeTrainer(vocab_size=80))
    wrapper = TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tok))
    prompts = PromptTokenizer(wrapper)
    assert not prompts.reuse
    text = "the cat sat on the mat " * 40
    for end in ("the cat", "on the mat"):
        assert prompts.encode(text + end) == list(wrapper.encode(text + end))
    assert prompts.hits == 0


@pytest.mark.parametrize(
    "change, ok",
    [
        ({}, True),
        ({"normalizer": {"type": "NFKC"}}, False),
        ({"model": {"type": "BPE", "dropout": 0.1}}, False),
        ({"model": {"type": "Unigram"}}, False),
        ({"added_tokens": [{"content": "<x>", "lstrip": True}]}, False),
        ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}, False),
        ({"pre_tokenizer": {"type": "Metaspace"}}, False),
        ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"(?<=a)b|\w+"}}}, False),
        ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"^\s+|\w+"}}}, False),
        ({"pre_tokenizer": {"type": "Split", "pattern": {"Regex": r"[^\s]+|\s+"}}}, True),
    ],
)
def test_reusable_reads_the_tokenizers_structure(change, ok):
    spec = json.loads(smollm2()._tokenizer.backend_tokenizer.to_str())
    assert reusable(spec)
    assert reusable({**spec, **change}) == ok


@pytest.mark.parametrize(
    "text, cut, ok",
    [
        ("the cat", 4, True),
        ("日本語", 1, True),  # ideographs compose with nothing
        ("x\u0301y", 1, False),  # a combining mark
        ("\u1100\u1161", 1, False),  # Hangul jamo: NFC joins them into one syllable
        ("e\u0301", 1, False),
    ],
)
def test_nfc_cuts_only_between_characters_it_keeps_apart(text, cut, ok):
    assert nfc_cut(text, cut) == ok


@given(a=st.text(max_size=40), b=st.text(max_size=40))
def test_shared_length_is_the_common_prefix(a, b):
    n = shared_length(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]
