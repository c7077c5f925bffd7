"""The target's vocabulary size, as speculators reads it: config.json's `vocab_size`, taken from
`text_config` when the target is a multimodal wrapper (speculators' get_target_vocab_size).

Stdlib only: prepare and vocab both size their arrays by it, and neither needs transformers
just to read one number.
"""

from __future__ import annotations

import os

from eyas.state.target import read_model_config


def target_vocab_size(target_path: str | os.PathLike) -> int:
    """The target's vocab_size; ValueError naming the file when it has none."""
    cfg = read_model_config(target_path)
    text = cfg.get("text_config")
    # speculators prefers text_config when there is one (AutoConfig(...).text_config).
    size = text.get("vocab_size") if isinstance(text, dict) and "vocab_size" in text else cfg.get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"{os.path.join(target_path, 'config.json')} has no vocab_size (nor text_config.vocab_size); "
            "point target.path at a complete model directory"
        )
    return size
