"""One row's regeneration, pure: its assistant spans read from the loss mask, each regenerated turn's prompt and budget, and the row the target's answers make.

A prepared row (prepare's input_ids and loss_mask) is [prefix][span 1][between 1][span 2]...
[span n][tail], where the spans are the runs of loss_mask == 1 (the assistant's tokens) and the
rest is what the template and the other roles wrote. The row is rebuilt left to right: the
original tokens are copied up to the next span to regenerate, the target's answer to everything
before it (the regenerated answers included) takes the span's place, and so on. Turn k's prompt
is therefore the row as regenerated so far, token for token, with no chat template rendered
again.

The end of a turn. A template either puts the end-of-turn token inside the assistant's mask (the
tiny test template's <|end|>, DeepSeek's <｜end▁of▁sentence｜>) or right after it (templates
that mark only the content). The target's answer ends with its own stop token (vLLM keeps it as
the last of token_ids), so the rebuilt row keeps exactly one end-of-turn where the original had
it: an answer's stop token is dropped when the original's end-of-turn follows the span (the
copied tokens bring it), and kept, trained on, when it was inside the span. What a template
writes after the end-of-turn inside the mask (a prefix-rendered mask takes ChatML's "\n" after
<|im_end|>) follows the answer, as context. An answer cut at max_tokens has no end: when the
original span held one, that token is put back, with loss 0 (the template's, not the target's:
the draft must not learn an end the target did not say).

A row is never longer than data.max_length, nor any prompt than the engine's context: a turn's
budget is the least of max_tokens and the room left under both (`limit`). A row whose first
regenerated turn has no room fails (`prompt_too_long`); a later turn with no room, or an answer
that filled the room, ends the row there (cut at max_length), as prepare truncates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

STOP, LENGTH = "stop", "length"  # vLLM's finish reasons
# How a regenerated turn ended: at a stop token, at max_tokens, or where the row's room ran out.
MAX_TOKENS, MAX_LENGTH = "max_tokens", "max_length"
FAIL_REASONS = ("prompt_too_long", "no_assistant_tokens", "no_trainable_tokens")


def spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """The runs of mask == 1, as half-open [start, end) intervals, in order."""
    out, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


def mask_of(length: int, runs: Sequence[Sequence[int]]) -> list[int]:
    """The loss mask of a row of `length` tokens whose runs of 1 are `runs` (spans' inverse)."""
    mask = [0] * length
    for start, end in runs:
        mask[start:end] = [1] * (end - start)
    return mask


def request_seed(seed: int, row: int, turn: int) -> int:
    """A sampling seed of one request, drawn from (seed, row, turn): the same on every attempt."""
    digest = hashlib.blake2b(f"{seed}:{row}:{turn}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


@dataclass
class RowJob:
    """The regeneration of one row, turn by turn: `pending()` says what to ask, `take()` what came back."""

    row: int
    ids: list[int]
    mask: list[int]
    stop_ids: frozenset[int]
    max_tokens: int
    max_length: int  # data.max_length: the row never grows past it
    context: int  # the engine's max_model_len: no prompt and answer together past it
    last_only: bool = False  # turns = "last": only the last span is regenerated
    out_ids: list[int] = field(default_factory=list)
    out_mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, str]] = field(default_factory=list)  # (tokens, STOP/MAX_TOKENS/MAX_LENGTH) per turn
    cut: bool = False  # the row reached its limit: cut at max_length
    failed: str | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        self.spans = spans(self.mask)
        todo = self.spans[-1:] if self.last_only else self.spans
        self._todo = list(todo)
        self._cursor = 0
        self.done = False
        if not self.spans:
            self._fail("no_assistant_tokens", "the row has no loss-masked (assistant) token")
            return
        self._copy_to(self._todo[0][0])

    @property
    def limit(self) -> int:
        return min(self.max_length, self.context)

    def pending(self) -> tuple[list[int], int] | None:
        """(the prompt, its token budget) of the next turn to generate; None once the row is done.
        A turn with no room fails the row (its first turn) or ends it (a later one)."""
        if self.done:
            return None
        room = self.limit - len(self.out_ids)
        budget = min(self.max_tokens, room)
        if budget > 0:
            return self.out_ids, budget
        n = len(self.out_ids)
        if not self.turns:
            if n >= self.context:
                why = f"the target's context is {self.context} tokens (max_model_len)"
            else:
                why = f"data.max_length is {self.max_length}"
            self._fail("prompt_too_long", f"its first prompt is {n} tokens and {why}: no room for an answer")
        else:
            self._end(cut=True)
        return None

    def take(self, tokens: Sequence[int], finish: str) -> None:
        """The answer to the pending turn: it takes the span's place (see the module docstring)."""
        prompt, budget = self.pending() or (None, 0)
        if prompt is None:
            raise RuntimeError(f"row {self.row}: an answer came for no pending turn")
        if finish not in (STOP, LENGTH):
            raise ValueError(f"row {self.row}: finish_reason {finish!r}, neither 'stop' nor 'length'")
        tokens = list(tokens)
        if len(tokens) > budget:
            raise RuntimeError(f"row {self.row}: {len(tokens)} tokens answered a turn of {budget} at most")
        start, end = self._todo.pop(0)
        stopped = finish == STOP and bool(tokens)
        # Cut by the room left under the row's limit rather than by max_tokens: the row ends here.
        full = not stopped and len(tokens) >= budget and budget < self.max_tokens
        self.turns.append((len(tokens), STOP if stopped else MAX_LENGTH if full else MAX_TOKENS))
        # The original's end of turn: the last stop token inside the span, and what the template
        # wrote after it within the mask (the prefix method's "\n" after <|im_end|>); else a stop
        # token right after the span, which the copied tokens bring.
        inside = [i for i in range(start, end) if self.ids[i] in self.stop_ids]
        end_at = inside[-1] if inside else None
        end_after = end_at is None and end < len(self.ids) and self.ids[end] in self.stop_ids
        answer = tokens[:-1] if stopped and end_after else tokens
        self._append(answer, 1)
        self._cursor = end
        if full:
            self._end(cut=True)
            return
        if end_at is not None:
            # The template's own tokens, which the target did not say: context, loss 0.
            self._append(([] if stopped else [self.ids[end_at]]) + self.ids[end_at + 1 : end], 0)
        if self._todo:
            self._copy_to(self._todo[0][0])
        else:
            self._copy_to(len(self.ids))
            self._end(cut=False)

    def record(self) -> dict:
        """What the rows file keeps of this row (ledger.py): the ids and the runs of the mask."""
        if not self.done:
            raise RuntimeError(f"row {self.row}: recorded before it was done")
        if self.failed is not None:
            return {"row": self.row, "failed": self.failed, "detail": self.detail}
        return {
            "row": self.row,
            "ids": self.out_ids,
            "spans": [list(s) for s in spans(self.out_mask)],
            "turns": [list(t) for t in self.turns],
            "cut": self.cut,
        }

    def _copy_to(self, end: int) -> None:
        """The original tokens from the cursor to `end`, as context (loss 0): user turns, template
        headers, and in "last" mode the earlier assistant turns as the data has them."""
        self._append(self.ids[self._cursor : end], 0)
        self._cursor = end

    def _append(self, tokens: Sequence[int], loss: int) -> None:
        self.out_ids.extend(tokens)
        self.out_mask.extend([loss] * len(tokens))

    def _end(self, cut: bool) -> None:
        self.done, self.cut = True, cut
        if len(self.out_ids) > self.max_length:  # the copied tail may overrun, as prepare's rows do
            self.cut = True
            del self.out_ids[self.max_length :], self.out_mask[self.max_length :]
        if not any(self.out_mask):
            self._fail("no_trainable_tokens", "the target answered every turn with its end-of-turn alone")

    def _fail(self, reason: str, detail: str) -> None:
        self.failed, self.detail, self.done = reason, detail, True
        self.out_ids, self.out_mask = [], []


def run_batch(jobs: Sequence[RowJob], answer) -> int:
    """Regenerate `jobs` turn by turn together: every job's next turn in one call of
    `answer(list of (job, prompt, budget)) -> list of (tokens, finish)`, until none is left.
    Returns the calls made."""
    calls = 0
    while True:
        asks = []
        for job in jobs:
            pending = job.pending()
            if pending is not None:
                asks.append((job, list(pending[0]), pending[1]))
        if not asks:
            return calls
        calls += 1
        for (job, _, _), (tokens, finish) in zip(asks, answer(asks), strict=True):
            job.take(tokens, finish)
