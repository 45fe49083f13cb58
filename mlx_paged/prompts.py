"""Prompts for ``mlx_paged.generate``: reading a prompts file, and encoding with a chat template."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_lm.tokenizer_utils import TokenizerWrapper


def read_prompts(path: str) -> list[str | list[dict]]:
    """Prompts from a file: plain lines, or JSONL lines holding a string,
    ``{"prompt": str}`` or ``{"messages": [...]}``. Blank lines are skipped.

    Raises:
        ValueError: for a JSON line of another shape, or an empty file.
    """
    prompts: list[str | list[dict]] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            prompts.append(line)  # a plain-text prompt
            continue
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, dict) and isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        else:
            raise ValueError(
                f"{path}:{n}: a JSON line must be a string, {{'prompt': ...}} or "
                "{'messages': [...]}."
            )
    if not prompts:
        raise ValueError(f"{path} holds no prompts.")
    return prompts


def encode_prompt(
    tokenizer: TokenizerWrapper,
    prompt: str | list[dict],
    args: argparse.Namespace,
) -> list[int]:
    """Token ids for a prompt, through the chat template unless told otherwise (as mlx_lm)."""
    use_chat = not args.ignore_chat_template and tokenizer.has_chat_template
    if not use_chat:
        if not isinstance(prompt, str):
            raise ValueError(
                "a messages list needs the chat template; drop --ignore-chat-template."
            )
        return tokenizer.encode(prompt)
    if isinstance(prompt, str):
        messages = (
            []
            if args.system_prompt is None
            else [{"role": "system", "content": args.system_prompt}]
        )
        messages.append({"role": "user", "content": prompt})
    else:
        messages = prompt
    prefill = args.prefill_response is not None
    if prefill:
        messages = [*messages, {"role": "assistant", "content": args.prefill_response}]
    kwargs = json.loads(args.chat_template_config) if args.chat_template_config else {}
    text = tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        continue_final_message=prefill,
        add_generation_prompt=not prefill,
        **kwargs,
    )
    return tokenizer.encode(text, add_special_tokens=False)
