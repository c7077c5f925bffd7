"""The doctor's tokenizer check: it loads, it has a chat template, and the assistant-only loss
mask that prepare will build (chat.MaskedRenderer, the same code) is right on a probe.

The probe is a two-turn chat. The mask must be non-empty, cover each assistant reply, and
never a user's words: a template that marks the wrong tokens trains the draft on the
prompt, and nothing downstream would notice.
"""

from __future__ import annotations

from eyas.workers.data import chat
from eyas.workers.doctor.check import Check, failed, passed, warned

GROUP = "tokenizer"

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
        fix = "put the tokenizer files (tokenizer.json, tokenizer_config.json) beside config.json"
        if not trust_remote_code and "trust_remote_code" in str(exc):
            fix = "set target.trust_remote_code = true (the tokenizer ships its own code)"
        return [
            failed(
                GROUP,
                "load",
                f"{path}: the tokenizer does not load ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})",
                fix,
            )
        ]
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
