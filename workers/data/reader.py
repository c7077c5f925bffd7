"""Reading prepare's input: JSON or JSONL files of chats (ShareGPT or OpenAI messages) or of
pre-tokenized rows, each row checked and normalized, or rejected with a reason.

A bad row never raises past this module except as a RowError carrying its reason, so that
prepare can skip it and count it. Only a file that cannot be split into rows at all (a JSON
array with a syntax error, or one too big to parse in memory) stops the stage, with a
message naming the file and the fix.

Memory stays bounded whatever a file holds: a JSONL line is read at most `row_byte_limit`
bytes at a time, and a longer one is skipped (counted as too_long) without ever being held
whole, parsed or rendered; a JSON array file is parsed only up to ARRAY_MAX_BYTES.

Row forms (data.format "auto" tells them apart per row, by their keys):
- sharegpt:  {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
- openai:    {"messages": [{"role": "system"|"user"|"assistant", "content": "..." | [text parts]}]}
- tokenized: {"input_ids": [int], "loss_mask": [0|1]}
Either chat form may also spell its turns with the other's keys (role/content, from/value),
as speculators' normalizer allows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

# Every reason a row can be skipped for, in the order a summary lists them.
SKIP_REASONS = (
    "too_long",  # the row's JSON text is over row_byte_limit(data.max_length) bytes
    "invalid_json",  # the line is not JSON
    "not_utf8",  # the line (or a string in it) is not UTF-8 text
    "wrong_type",  # a value of the wrong JSON type (a turn that is a number, content 42...)
    "missing_field",  # no conversations / messages / input_ids + loss_mask
    "empty_conversation",  # an empty list of turns
    "missing_role",  # a turn without "from"/"role"
    "unknown_role",  # a role that is not system, user or assistant (or a ShareGPT alias)
    "empty_content",  # a turn whose content is absent, null or blank; an empty token list
    "length_mismatch",  # tokenized: input_ids and loss_mask differ in length
    "token_out_of_range",  # tokenized: an id outside the target's vocabulary
    "template_error",  # the chat template raised on this conversation
    "no_trainable_tokens",  # nothing left to learn from after masking and truncation
)

# ShareGPT's names and the OpenAI ones, lowercased. A tool turn is not supported: a template
# that does not know the role would drop it silently, so it is refused as unknown.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}

# A row is refused unread when its JSON text is over max_length × ROW_BYTES_PER_TOKEN bytes
# (and over ROW_BYTES_MIN). 64 bytes per token is generous for every real form: chat text runs
# about 4 bytes per token in English and at most ~12 for CJK or emoji escaped as \uXXXX, and a
# pre-tokenized row spends ~10 per token ("12345, " plus "1, "); turn keys and roles add a
# little per turn. Truncation at max_length would keep about a sixteenth of a row over it,
# at 4 bytes a token, and rendering and tokenising the whole row first is what costs memory:
# a 200 MB row took prepare to 22 GB before it was cut. The floor keeps long prompts (RAG
# context, long system prompts) at small max_length values.
ROW_BYTES_PER_TOKEN = 64
ROW_BYTES_MIN = 1 << 20
# A JSON array is one document: json parses all of it at once (its bytes, the decoded text
# and the Python objects, several times the file's size), so a bigger one is refused with a
# pointer to JSONL, which is read a line at a time. Streaming an array would need a parser
# that can also skip an over-long element without building it; the stdlib has none.
ARRAY_MAX_BYTES = 128 << 20
# How much of a too-long line is read at a time while skipping to its end.
SKIP_CHUNK = 1 << 20


def row_byte_limit(max_length: int) -> int:
    """The most bytes of JSON text a row may have for data.max_length = `max_length`."""
    return max(ROW_BYTES_MIN, max_length * ROW_BYTES_PER_TOKEN)


_CHAT_KEYS = {"sharegpt": ("conversations", "from", "value"), "openai": ("messages", "role", "content")}


class RowError(Exception):
    """One row is unusable: `reason` is one of SKIP_REASONS, `detail` says what was wrong."""

    def __init__(self, reason: str, detail: str):
        assert reason in SKIP_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class DataError(ValueError):
    """The input as a whole is unusable (no files, a JSON array that does not parse)."""


@dataclass(frozen=True)
class RawRow:
    where: str  # "chat.jsonl:17" (line) or "chat.json[16]" (array index)
    value: Any = None  # the parsed JSON value
    error: RowError | None = None


@dataclass(frozen=True)
class Chat:
    messages: list[dict[str, str]]  # [{"role": "system"|"user"|"assistant", "content": str}]


@dataclass(frozen=True)
class Tokens:
    input_ids: list[int]
    loss_mask: list[int]


def data_files(path: str | os.PathLike) -> list[Path]:
    """`path` itself, or every *.json / *.jsonl under it (sorted, hidden files left out)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"data.path: {path} does not exist; point it at a .jsonl/.json file or a directory of them")
    files = sorted(
        p
        for p in path.rglob("*")
        if p.suffix in (".json", ".jsonl")
        and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    if not files:
        raise DataError(f"data.path: {path} holds no .json or .jsonl file; put the dataset there or point at a file")
    return files


def _strip_bom(data: bytes) -> bytes:
    return data[3:] if data.startswith(b"\xef\xbb\xbf") else data


def _is_array(data: bytes) -> bool:
    """A JSON array file starts with "[" (after blanks); anything else is read as JSONL, whatever
    its suffix, since files named .json often hold one object per line."""
    return data.lstrip()[:1] == b"["


def _parse_array(path: Path) -> list:
    size = path.stat().st_size
    if size > ARRAY_MAX_BYTES:
        raise DataError(
            f"{path}: a JSON array of {size / 1e6:.0f} MB is too big to parse in memory (the limit is "
            f"{ARRAY_MAX_BYTES / 1e6:.0f} MB); write one JSON object per line (JSONL), which is read a "
            f"line at a time, e.g. jq -c '.[]' {path} > {path.with_suffix('.jsonl')}"
        )
    data = _strip_bom(path.read_bytes())
    # surrogateescape keeps a stray non-UTF-8 byte inside the row it belongs to (as a lone
    # surrogate, found when the row is normalized) instead of failing the whole file.
    try:
        value = json.loads(data.decode("utf-8", "surrogateescape"))
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{path}: line {exc.lineno}, column {exc.colno}: not valid JSON ({exc.msg}); fix it, "
            "or write one JSON object per line (JSONL) so that bad rows are skipped"
        ) from None
    except RecursionError:
        raise DataError(
            f"{path}: nested too deeply to parse as JSON; write one JSON object per line (JSONL) "
            "so that bad rows are skipped"
        ) from None
    return value if isinstance(value, list) else [value]


def is_array_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return is_array_head(f.read(4096))


def is_array_head(head: bytes) -> bool:
    """Whether a file that starts with `head` is one JSON array (else it is read as JSONL)."""
    return _is_array(_strip_bom(head))


def lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, the line, its length in bytes) of every non-blank line of a binary file;
    the line is None when it is over `limit` bytes: it was read and dropped a chunk at a time,
    so no more than `limit` bytes of it were ever held.

    readline(size) is the library's bounded read; the rest of a long line is skipped with it
    too, in SKIP_CHUNK pieces, until the piece that ends with the newline.
    """
    lineno = 0
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        lineno += 1
        if lineno == 1:
            line = _strip_bom(line)
        if len(line) > limit and not (len(line) == limit + 1 and line.endswith(b"\n")):
            length = len(line)
            while not line.endswith(b"\n"):
                line = f.readline(SKIP_CHUNK)
                if not line:
                    break
                length += len(line)
            yield lineno, None, length
        elif line.strip():
            yield lineno, line, len(line)


def count_rows(files: list[Path], limit: int = ROW_BYTES_MIN) -> int:
    """How many rows `read_rows` will yield (non-blank lines, or array entries)."""
    total = 0
    for path in files:
        if is_array_file(path):
            total += len(_parse_array(path))
        else:
            with open(path, "rb") as f:
                total += sum(1 for _ in lines(f, limit))
    return total


def read_rows(files: list[Path], limit: int = ROW_BYTES_MIN) -> Iterator[RawRow]:
    """Every row of every file, parsed, or carrying why it could not be parsed; a row over
    `limit` bytes of JSON text (row_byte_limit) carries too_long and is never parsed."""
    for path in files:
        name = path.name
        if is_array_file(path):
            for i, value in enumerate(_parse_array(path)):
                # The array is parsed already (bounded by ARRAY_MAX_BYTES); what must not
                # happen to a huge element is rendering and tokenising it. Its size is that of
                # its JSON text written back, which stays within the file's own size.
                size = len(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
                if size > limit:
                    yield RawRow(f"{name}[{i}]", error=_too_long(size, limit))
                else:
                    yield RawRow(f"{name}[{i}]", value)
            continue
        with open(path, "rb") as f:
            for lineno, line, length in lines(f, limit):
                where = f"{name}:{lineno}"
                if line is None:
                    yield RawRow(where, error=_too_long(length, limit))
                    continue
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    why = f"byte {exc.start} (0x{line[exc.start]:02x}) is not UTF-8"
                    yield RawRow(where, error=RowError("not_utf8", why))
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    yield RawRow(where, error=RowError("invalid_json", f"character {exc.pos}: {exc.msg}"))
                except RecursionError:
                    yield RawRow(where, error=RowError("invalid_json", "nested too deeply to parse"))
                else:
                    yield RawRow(where, value)


def _too_long(size: int, limit: int) -> RowError:
    return RowError(
        "too_long",
        f"{size} bytes of JSON, over the {limit}-byte limit for data.max_length "
        f"(max_length × {ROW_BYTES_PER_TOKEN}, at least {ROW_BYTES_MIN}); split the row or "
        f"raise data.max_length",
    )


def _type(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _check_utf8(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError("not_utf8", f"{what} holds a character that is not UTF-8 text at {exc.start}") from None


def detect(value: dict) -> str:
    """The form of one row, by its keys."""
    if "input_ids" in value or "loss_mask" in value:
        return "tokenized"
    if "conversations" in value:
        return "sharegpt"
    if "messages" in value:
        return "openai"
    raise RowError("missing_field", "no 'conversations', 'messages' or 'input_ids' + 'loss_mask'")


def normalize(value: Any, fmt: str, vocab_size: int) -> Chat | Tokens:
    """One parsed row as a Chat or Tokens; RowError when it is malformed."""
    if not isinstance(value, dict):
        raise RowError("wrong_type", f"a row must be a JSON object, got {_type(value)}")
    kind = detect(value) if fmt == "auto" else fmt
    if kind == "tokenized":
        return _tokens(value, vocab_size)
    key, role_key, content_key = _CHAT_KEYS[kind]
    if key not in value:
        raise RowError("missing_field", f"no '{key}' (data.format is \"{fmt}\")")
    return Chat(_turns(value[key], key, role_key, content_key))


def _turns(turns: Any, key: str, role_key: str, content_key: str) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise RowError("wrong_type", f"'{key}' must be an array of turns, got {_type(turns)}")
    if not turns:
        raise RowError("empty_conversation", f"'{key}' is empty")
    alt_role, alt_content = ("role", "content") if role_key == "from" else ("from", "value")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("wrong_type", f"turn {i} must be an object, got {_type(turn)}")
        role = turn.get(role_key, turn.get(alt_role))
        if role is None:
            raise RowError("missing_role", f"turn {i} has no '{role_key}'")
        if not isinstance(role, str):
            raise RowError("wrong_type", f"turn {i}: '{role_key}' must be a string, got {_type(role)}")
        _check_utf8(role, f"turn {i}'s role")
        canonical = ROLES.get(role.strip().lower())
        if canonical is None:
            raise RowError(
                "unknown_role",
                f"turn {i}: role {role!r} is not one of system, user, assistant (or ShareGPT's human, gpt)",
            )
        content = _text(turn.get(content_key, turn.get(alt_content)), i, content_key)
        _check_utf8(content, f"turn {i}'s content")
        if not content.strip():
            raise RowError("empty_content", f"turn {i} ({canonical}) has no content")
        messages.append({"role": canonical, "content": content})
    return messages


def _text(content: Any, i: int, key: str) -> str:
    """A turn's content as text: a string, or OpenAI's list of text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                # Images and other media need a processor, which prepare does not run.
                raise RowError(
                    "wrong_type",
                    f"turn {i}: only text parts are supported in '{key}', got "
                    f"{part.get('type') if isinstance(part, dict) else _type(part)!r}",
                )
        return "".join(parts)
    raise RowError("wrong_type", f"turn {i}: '{key}' must be a string, got {_type(content)}")


def _int_list(value: Any, key: str, bools: bool) -> list[int]:
    if not isinstance(value, list):
        raise RowError("wrong_type", f"'{key}' must be an array of integers, got {_type(value)}")
    for j, v in enumerate(value):
        # A mask may say true/false; a token id may not.
        if not isinstance(v, int) or (isinstance(v, bool) and not bools):
            raise RowError("wrong_type", f"'{key}'[{j}] must be an integer, got {_type(v)}")
    return value


def _tokens(value: dict, vocab_size: int) -> Tokens:
    for key in ("input_ids", "loss_mask"):
        if key not in value:
            raise RowError(
                "missing_field", f"a pre-tokenized row needs 'input_ids' and 'loss_mask'; '{key}' is missing"
            )
    ids = _int_list(value["input_ids"], "input_ids", bools=False)
    mask = _int_list(value["loss_mask"], "loss_mask", bools=True)
    if len(ids) != len(mask):
        raise RowError("length_mismatch", f"input_ids has {len(ids)} tokens, loss_mask {len(mask)}")
    if not ids:
        raise RowError("empty_content", "input_ids is empty")
    bad = next((m for m in mask if m not in (0, 1)), None)
    if bad is not None:
        raise RowError("wrong_type", f"loss_mask must hold 0 or 1, got {bad}")
    out = next((t for t in ids if not 0 <= t < vocab_size), None)
    if out is not None:
        raise RowError("token_out_of_range", f"token id {out} is outside the target's vocabulary (0..{vocab_size - 1})")
    return Tokens([int(t) for t in ids], [int(m) for m in mask])
