"""The evaluate stage's figures, from vLLM's counters and outputs. Pure Python, no vLLM.

- mean acceptance length = 1 + accepted / drafts: the tokens one target forward yields (the
  accepted draft tokens plus the target's own next token), vLLM's own definition
  (SpecDecodingLogging: "Conventionally, mean acceptance length includes the bonus token");
- acceptance rate at draft position i = drafts whose token i was accepted / drafts (vLLM
  accepts a prefix, so these fall with i);
- acceptance rate = accepted / draft tokens;
- lossless: each prompt's greedy token ids with a draft equal the target's alone, exactly.
"""

from __future__ import annotations

from typing import Any


def acceptance(counters: dict[str, Any]) -> dict[str, Any]:
    drafts, proposed, accepted = counters["drafts"], counters["draft_tokens"], counters["accepted"]
    if drafts <= 0:
        raise ValueError(
            "vLLM counted no drafts: speculative decoding did not run (the prompts' answers "
            "ended before a draft was proposed?); raise evaluate.max_tokens"
        )
    return {
        "acceptance_length": 1.0 + accepted / drafts,
        "acceptance_rate": accepted / proposed if proposed else 0.0,
        "per_position": [n / drafts for n in counters["accepted_per_pos"]],
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
    }


def compare(reference: list[list[int]], other: list[list[int]], rows: list[int] | None = None) -> dict[str, Any]:
    """How `other`'s outputs differ from the reference's: the number of prompts whose token ids
    differ and where the first of them parts."""
    if len(reference) != len(other):
        raise ValueError(f"{len(other)} outputs for {len(reference)} prompts")
    differing = [i for i, (a, b) in enumerate(zip(reference, other)) if a != b]
    out: dict[str, Any] = {"prompts": len(reference), "mismatched_prompts": len(differing), "first_mismatch": None}
    if differing:
        i = differing[0]
        a, b = reference[i], other[i]
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out["first_mismatch"] = {
            "prompt": i,
            "row": rows[i] if rows else None,
            "position": pos,
            "expected": a[pos] if pos < len(a) else None,
            "got": b[pos] if pos < len(b) else None,
            "expected_length": len(a),
            "got_length": len(b),
        }
    return out


def mismatch_text(label: str, diff: dict[str, Any]) -> str:
    """`trained draft: 2 of 30 prompts differ (first: prompt 4 (row 37), token 12: 345 instead of 123)`."""
    first = diff["first_mismatch"]
    row = f" (dataset row {first['row']})" if first.get("row") is not None else ""
    if first["expected"] is None or first["got"] is None:
        what = f"{first['got_length']} tokens instead of {first['expected_length']}"
    else:
        what = f"token {first['got']} instead of {first['expected']}"
    return (
        f"{label}: {diff['mismatched_prompts']} of {diff['prompts']} prompts differ (first: prompt "
        f"{first['prompt']}{row}, output position {first['position']}: {what})"
    )
