"""The evaluate stage's held-out prompts, as token ids.

Two sources:
- the validation split of the prepare stage (default): one prompt per assistant turn of each
  held-out row, the row's tokens before that turn's first loss-masked token, i.e. the
  conversation up to each point where the target starts answering (the earlier turns' answers
  are the dataset's), rendered exactly as the draft saw it in training. Every turn, not only
  the first: a chat's first answers are not its typical ones (on the demo they are its
  shortest), and a small validation split gives about twice the prompts (the demo: 56 from 30
  chats). A chat's turns share its topic and style, so the stage's bootstrap resamples whole
  chats (workers/evaluate/bootstrap.py), never its turns one by one;
- evaluate.prompts, a JSONL file, one prompt per line, in any of these forms:
    {"prompt": "text"}                 tokenized as is (the tokenizer's own special tokens)
    {"prompt_token_ids": [1, 2, 3]}    used as is
    {"messages": [...]} / {"conversations": [...]}
                                       a chat (OpenAI or ShareGPT form, as [data] reads them),
                                       rendered with the target's chat template and its
                                       generation prompt; trailing assistant turns are left out
                                       (they are the reference answer, not the prompt).
A line that is none of these stops the stage with its line number: an evaluation set is small
and should be exactly what the user meant, so nothing is skipped silently.
"""

from __future__ import annotations

import json
from pathlib import Path


class PromptError(ValueError):
    """The prompts cannot be read."""


def turn_starts(mask: list[int]) -> list[int]:
    """Where each answer starts: the positions of loss-masked tokens that follow an unmasked
    one (a mask that starts masked has no prompt before its first answer)."""
    return [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]


def from_validation(prepare_dir: Path, limit: int) -> tuple[list[list[int]], list[int]]:
    """(prompts, the dataset row of each): one prompt per assistant turn of the validation rows,
    in row order and turn order, the first `limit` (0: all) of them."""
    from datasets import load_from_disk

    splits, ds_path = prepare_dir / "splits.json", prepare_dir / "dataset"
    if not splits.exists() or not ds_path.is_dir():
        raise PromptError(
            f"{prepare_dir}: no splits.json / dataset; run the prepare stage first, or set "
            "evaluate.prompts to a prompt file"
        )
    rows = sorted(int(i) for i in json.loads(splits.read_text()).get("validation", []))
    if not rows:
        raise PromptError(
            f"{splits}: no validation rows (data.validation_fraction = 0); set "
            "data.validation_fraction > 0 or evaluate.prompts to a prompt file"
        )
    data = load_from_disk(str(ds_path)).with_format(None)
    prompts, used = [], []
    for row in rows:
        item = data[row]
        for start in turn_starts(list(item["loss_mask"])):
            prompts.append([int(t) for t in item["input_ids"][:start]])
            used.append(row)
            if limit and len(prompts) >= limit:
                return prompts, used
    if not prompts:
        raise PromptError(
            f"{splits}: none of the {len(rows)} validation rows has a prompt before an assistant "
            "turn; set evaluate.prompts to a prompt file"
        )
    return prompts, used


def from_file(path: Path, target_path: str, trust_remote_code: bool, vocab_size: int, limit: int) -> list[list[int]]:
    """The first `limit` (0: all) prompts of a JSONL prompt file, as token ids."""
    from eyas.workers.data.reader import Chat, RowError, normalize

    tokenizer = None
    prompts: list[list[int]] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptError(f"evaluate.prompts: cannot read {path} ({exc}); point it at a UTF-8 JSONL file") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptError(f"{where}: not JSON ({exc.msg}); write one JSON object per line") from None
        if not isinstance(value, dict):
            raise PromptError(f'{where}: expected a JSON object like {{"prompt": "..."}}')
        if "prompt_token_ids" in value:
            ids = value["prompt_token_ids"]
            if not (
                isinstance(ids, list)
                and ids
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids)
            ):
                raise PromptError(
                    f"{where}: prompt_token_ids must be a non-empty array of token ids from 0 to {vocab_size - 1}"
                )
        else:
            if tokenizer is None:
                from eyas.workers.data.chat import load_tokenizer

                tokenizer = load_tokenizer(target_path, trust_remote_code)
            if "prompt" in value:
                if not isinstance(value["prompt"], str) or not value["prompt"]:
                    raise PromptError(f'{where}: "prompt" must be a non-empty string')
                ids = list(tokenizer(value["prompt"])["input_ids"])
            else:
                try:
                    chat = normalize(value, "auto", vocab_size)
                except RowError as exc:
                    raise PromptError(
                        f'{where}: {exc.detail}; write {{"prompt": "..."}}, '
                        '{"prompt_token_ids": [...]} or a chat ("messages")'
                    ) from None
                if not isinstance(chat, Chat):
                    raise PromptError(f'{where}: a pre-tokenized training row; write {{"prompt_token_ids": [...]}}')
                ids = _render(tokenizer, chat.messages, where)
        prompts.append([int(t) for t in ids])
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise PromptError(f"evaluate.prompts: {path} holds no prompt; write one JSON object per line")
    return prompts


def _render(tokenizer, messages: list[dict[str, str]], where: str) -> list[int]:
    while messages and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise PromptError(f"{where}: the chat holds only assistant turns; give the turns before the answer")
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    except Exception as exc:  # noqa: BLE001 - a template may raise anything
        raise PromptError(f"{where}: the chat template failed on this chat ({type(exc).__name__}: {exc})") from None
    return list(ids)
