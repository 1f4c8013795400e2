"""A conversation (as template dicts, from either API) -> prompt token ids, and logprobs as the
clients want them. The chat template lives with the tokenizer; this only reports its errors as
a 400 instead of a crash."""

from __future__ import annotations

import jinja2

from astrai.serve.errors import bad_request
from astrai.tokenizer import reads_content_parts

# OpenAI writes -inf logprobs as this number; JSON has no infinity.
MIN_LOGPROB = -9999.0


def chat_prompt(
    tokenizer, messages: list[dict], tools: list[dict] | None, prefix: str = ""
) -> list[int]:
    """Render and encode; `prefix` starts the answer (an assistant turn to continue)."""
    try:
        if not reads_content_parts(tokenizer.template_for(tools)):
            messages = [joined_parts(m) for m in messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except (jinja2.TemplateError, TypeError, KeyError, ValueError) as exc:
        # e.g. a Hugging Face template that insists on alternating roles
        raise bad_request(f"The chat template refused these messages: {exc}", "messages") from None
    return tokenizer.encode(text + prefix)


def joined_parts(message: dict) -> dict:
    """A message whose content is a list of text parts, with the texts joined by newlines:
    what a template that prints content as one string needs (OpenAI clients send either)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = [p["text"] for p in content if p.get("type", "text") == "text"]
    return {**message, "content": "\n".join(texts)}


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def finite(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise bad_request(
            f"{param}: token ids must be in 0..{vocab_size - 1}, got {bad[:5]}", param
        )


def prompt_ids(tokenizer, data, vocab_size: int, param: str) -> list[list[int]]:
    """A text-or-tokens field (`prompt`, `input`) -> token id lists. It may be a text, a list of
    texts, a list of token ids or a list of such lists, but not a mix."""
    if isinstance(data, str):
        return [tokenizer.encode(data)]
    if not data:
        raise bad_request(f"{param} is an empty list.", param)
    kinds = {type(item) for item in data}
    if len(kinds) > 1:
        raise bad_request(f"{param} mixes texts, token ids and lists of token ids.", param)
    if kinds == {str}:
        return [tokenizer.encode(text) for text in data]
    batch = [data] if kinds == {int} else data
    for ids in batch:
        check_token_ids(ids, vocab_size, param)
    return batch
