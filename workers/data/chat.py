"""Rendering a chat with the target's template into token ids and an assistant-only loss mask.

Two ways to find the assistant tokens, chosen once per template:
- "generation": the template marks assistant output with {% generation %}; transformers then
  returns the mask itself (return_assistant_tokens_mask).
- "prefix": otherwise. For each assistant turn j, the conversation up to j is rendered with
  the generation prompt; the tokens that rendering turn j adds after it are the assistant's.
  This is only sound if every earlier render is a prefix of the full one, so a template that
  re-renders history differently (one that drops earlier reasoning, say) is refused, naming
  the turn. Like speculators' boundary renderer, a generation prompt that differs from the
  recorded turn (a pre-filled <think> scaffold) falls back to the common prefix, provided the
  history itself agrees.
Reasoning (<think>...</think>) is part of an assistant turn's content, so it is trained on.
An assistant turn with nothing before it has no prompt to measure against: it stays context,
as in speculators.
"""

from __future__ import annotations

import re
from typing import Any

# The test transformers itself applies before it will track generation blocks.
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


class TemplateMismatch(ValueError):
    """The template re-renders history differently: prefix masks cannot be derived from it."""

    def __init__(self, turn: int, message: str):
        super().__init__(message)
        self.turn = turn


class RenderError(Exception):
    """The template failed on one conversation (it raised, e.g. on roles that do not alternate)."""


def load_tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def template_of(tokenizer, where: str) -> str:
    try:
        return tokenizer.get_chat_template()
    except ValueError:
        raise ValueError(
            f"{where}: the tokenizer has no chat template; add one (chat_template.jinja or "
            "tokenizer_config.json's chat_template) or give pre-tokenized rows "
            "(input_ids + loss_mask)"
        ) from None


class MaskedRenderer:
    """Render chats with one tokenizer's template; `method` is "generation" or "prefix"."""

    def __init__(self, tokenizer, template: str | None = None, where: str = "target"):
        self.tokenizer = tokenizer
        self.template = template if template is not None else template_of(tokenizer, where)
        # transformers maps {% generation %} blocks to tokens through char_to_token, which only
        # fast tokenizers have; a slow one (some trust_remote_code tokenizers) renders prefixes.
        marked = GENERATION_TAG.search(self.template) is not None
        self.method = "generation" if marked and getattr(tokenizer, "is_fast", False) else "prefix"

    def render(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        """(input_ids, loss_mask) of one conversation; RenderError if the template raises,
        TemplateMismatch if the prefix method finds history re-rendered differently."""
        if self.method == "generation":
            out = self._apply(messages, return_dict=True, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        return self._prefix_render(messages)

    def _apply(self, messages: list[dict[str, str]], **kwargs) -> Any:
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template may raise anything; the row is skipped
            raise RenderError(f"{type(exc).__name__}: {exc}") from exc

    def _ids(self, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
        return list(self._apply(messages, return_dict=False, add_generation_prompt=generation_prompt))

    def _prefix_render(self, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
        full = self._ids(messages, False)
        mask = [0] * len(full)
        for j, turn in enumerate(messages):
            if turn["role"] != "assistant" or j == 0:
                continue
            prompt = self._ids(messages[:j], True)
            upto = self._ids(messages[: j + 1], False)
            if upto[: len(prompt)] == prompt:
                start = len(prompt)
            else:
                # The generation prompt is not how the recorded turn starts (a pre-filled
                # scaffold): use the common prefix, valid only if the history agrees.
                start = _common_prefix(prompt, upto)
                history = self._ids(messages[:j], False)
                if upto[: len(history)] != history or start < len(history):
                    raise self._mismatch(j, history, upto, "the turns before it render differently once it follows")
            if full[: len(upto)] != upto:
                raise self._mismatch(j, upto, full, "it renders differently once later turns follow")
            mask[start : len(upto)] = [1] * (len(upto) - start)
        return full, mask

    def _mismatch(self, j: int, alone: list[int], followed: list[int], what: str) -> TemplateMismatch:
        k = _common_prefix(alone, followed)
        a, b = (self.tokenizer.convert_ids_to_tokens(x[k]) if k < len(x) else "<end>" for x in (alone, followed))
        return TemplateMismatch(
            j,
            (
                f"the chat template re-renders the conversation at turn {j} (assistant): {what} "
                f"(first difference at token {k}: {a!r} vs {b!r}), so the assistant mask cannot be derived "
                "by rendering prefixes; mark the assistant content with {% generation %}...{% endgeneration %} "
                "in the template, or give pre-tokenized rows (input_ids + loss_mask)"
            ),
        )


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
