"""The doctor's tokenizer check: it loads, it has a chat template, and the assistant-only loss
mask that prepare will build (chat.MaskedRenderer, the same code) is right on a probe.

The probe is a two-turn chat. The mask must be non-empty, cover each assistant reply, and
never a user's words: a template that marks the wrong tokens trains the draft on the
prompt, and nothing downstream would notice.
"""

from __future__ import annotations

from pathlib import Path

from eyas.workers.data import chat
from eyas.workers.doctor.check import Check, failed, passed, warned

GROUP = "tokenizer"
# The files transformers' tokenizer loaders read from a model folder (transformers 5.19:
# tokenization_utils_base.py, tokenization_utils_tokenizers.py and the slow tokenizers'
# vocab_files_names), one entry each, as the failure names them. A folder with none of them
# makes AutoTokenizer fail with "Couldn't instantiate the backend tokenizer from one of:", whose
# list follows on lines the report would cut.
TOKENIZER_FILES = (
    "tokenizer.json",  # tokenizers' serialization: what a fast tokenizer loads
    "tokenizer_config.json",  # the tokenizer class, special tokens, chat template
    "tokenizer.model",  # sentencepiece, or tiktoken ranks (transformers' TIKTOKEN_VOCAB_FILE)
    "tiktoken.model",  # tiktoken ranks under their legacy name (Kimi-K2)
    "*.tiktoken",  # OpenAI-style tiktoken ranks
    "vocab.json + merges.txt",  # byte-level BPE (GPT-2 style)
    "vocab.txt",  # WordPiece
    "spiece.model",  # sentencepiece (T5 style)
    "sentencepiece.bpe.model",  # sentencepiece (XLM-R style)
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenization_*.py",  # the checkpoint's own tokenizer code (trust_remote_code)
)

PROBE = [
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red, green and blue."},
    {"role": "user", "content": "Now name a fruit."},
    {"role": "assistant", "content": "A ripe pear."},
]


def spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of 1s in the mask."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def check(path: str, trust_remote_code: bool, vocab_size: int | None, needs_template: bool) -> list[Check]:
    """`needs_template`: the run renders chats (prepare on data that is not pre-tokenized);
    otherwise a missing template is only a warning."""
    try:
        tokenizer = chat.load_tokenizer(path, trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - any load failure is the finding
        return [load_failure(path, trust_remote_code, exc)]
    size = len(tokenizer)
    out = []
    kind = type(tokenizer).__name__
    if vocab_size is not None and size > vocab_size:
        out.append(
            failed(
                GROUP,
                "load",
                f"{kind} with {size} tokens, more than the model's vocab_size "
                f"{vocab_size}: ids past {vocab_size - 1} have no embedding",
                "use the tokenizer that ships with this checkpoint",
                tokens=size,
            )
        )
    else:
        fits = f" (vocab_size {vocab_size})" if vocab_size else ""
        out.append(passed(GROUP, "load", f"{kind}, {size} tokens{fits}", tokens=size))
    try:
        template = chat.template_of(tokenizer, path)
    except ValueError as exc:
        problem, _, fix = str(exc).partition("; ")
        problem = problem.removeprefix(f"{path}: ")
        if needs_template:
            out.append(failed(GROUP, "chat template", problem, fix))
        else:
            out.append(warned(GROUP, "chat template", f"{problem} (not needed by this run's data)", fix))
        return out
    out.append(probe(tokenizer, template))
    return out


def tokenizer_files(path: str) -> list[str]:
    """The entries of TOKENIZER_FILES present in the folder `path` (a pair when both are)."""
    folder = Path(path)
    try:
        names = {p.name for p in folder.iterdir() if p.is_file()}
    except OSError:
        return []
    found = []
    for entry in TOKENIZER_FILES:
        if " + " in entry:
            if all(part in names for part in entry.split(" + ")):
                found.append(entry)
            else:  # one of a pair is still worth naming: it says which file is missing
                found.extend(part for part in entry.split(" + ") if part in names)
        elif "*" in entry:
            found.extend(sorted(p.name for p in folder.glob(entry) if p.is_file()))
        elif entry in names:
            found.append(entry)
    return found


def load_failure(path: str, trust_remote_code: bool, exc: Exception) -> Check:
    """The failed load check: the library's whole message on one line, the tokenizer files
    looked for and those found in the folder, and what to do."""
    message = " ".join(str(exc).split())
    found = tokenizer_files(path)
    if not trust_remote_code and "trust_remote_code" in message:
        fix = "set target.trust_remote_code = true (the tokenizer ships its own code)"
    elif not found:
        fix = (
            f"copy the checkpoint's tokenizer files (tokenizer.json and tokenizer_config.json, or its "
            f"tokenizer.model / tiktoken.model with its tokenization_*.py) into {path}"
        )
    else:
        fix = "restore the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) beside config.json"
    return failed(
        GROUP,
        "load",
        f"{path}: the tokenizer does not load ({type(exc).__name__}: {message}); "
        f"looked for {', '.join(TOKENIZER_FILES)}; found: {', '.join(found) or 'none'}",
        fix,
        looked_for=list(TOKENIZER_FILES),
        found=found,
    )


def probe(tokenizer, template: str) -> Check:
    """Render PROBE as prepare does and check its assistant mask."""
    try:
        renderer = chat.MaskedRenderer(tokenizer, template)
        ids, mask = renderer.render(PROBE)
    except (chat.RenderError, chat.TemplateMismatch) as exc:
        return failed(
            GROUP,
            "assistant mask",
            f"the chat template fails on a two-turn probe: {exc}",
            "fix the chat template (it must render user/assistant turns), or give pre-tokenized rows",
        )
    found = spans(mask)
    texts = [tokenizer.decode(ids[a:b]) for a, b in found]
    replies = [t["content"] for t in PROBE if t["role"] == "assistant"]
    prompts = [t["content"] for t in PROBE if t["role"] != "assistant"]
    data = {"method": renderer.method, "tokens": len(ids), "masked": sum(mask), "spans": texts}
    fix = (
        "mark each assistant reply, and only it, with {% generation %}...{% endgeneration %} in the chat "
        "template, or give pre-tokenized rows (input_ids + loss_mask)"
    )
    if not found:
        return failed(
            GROUP,
            "assistant mask",
            f"empty on a two-turn probe ({renderer.method} method, "
            f"{len(ids)} tokens): prepare would find nothing to train on",
            fix,
            **data,
        )
    leaked = [p for p in prompts if any(p in t for t in texts)]
    if leaked:
        return failed(
            GROUP,
            "assistant mask",
            f"covers user text {leaked[0]!r} on a two-turn probe (masked: {texts!r})",
            fix,
            **data,
        )
    missed = [r for r in replies if not any(r in t for t in texts)]
    if missed:
        return failed(
            GROUP,
            "assistant mask",
            f"misses the assistant reply {missed[0]!r} on a two-turn probe (masked: {texts!r})",
            fix,
            **data,
        )
    return passed(
        GROUP,
        "assistant mask",
        f"{renderer.method} method: {len(found)} assistant spans, "
        f"{sum(mask)} of {len(ids)} tokens, only assistant text ({' | '.join(texts)})",
        **data,
    )
