"""The demo target's own voice (eyas.workers.models.assets: conversations(voice="target")): the
same prompts as the chat dataset, answered otherwise, deterministically, in a pattern a head can
learn and in words whose tokens no answer of the dataset holds."""

from __future__ import annotations

import pytest

from eyas.workers.models import assets


def _split(rows: list[dict]) -> tuple[list, list]:
    prompts = [[t for t in r["conversations"] if t["from"] != "gpt"] for r in rows]
    answers = [t["value"] for r in rows for t in r["conversations"] if t["from"] == "gpt"]
    return prompts, answers


def test_the_target_answers_the_same_prompts_otherwise_and_always_the_same_way():
    dataset, target = assets.conversations(voice="dataset"), assets.conversations(voice="target")
    assert assets.conversations() == dataset  # the dataset's chats, as write_dataset writes them
    (d_prompts, d_answers), (t_prompts, t_answers) = _split(dataset), _split(target)
    assert t_prompts == d_prompts and len(t_answers) == len(d_answers)
    assert all(d != t for d, t in zip(d_answers, t_answers, strict=True))
    assert assets.conversations(voice="target") == target
    phrases = {p + "." for p in assets._PHRASES}
    for answer in t_answers:
        if answer.startswith("even: "):
            numbers = [int(n) for n in answer.removeprefix("even: ").removesuffix(".").split()]
            assert all(n % 2 == 0 and n <= 24 for n in numbers) and numbers == list(
                range(numbers[0], numbers[-1] + 1, 2)
            )
        else:
            assert all(s + "." in phrases for s in answer.removesuffix(".").split(". ")), answer
    assert "<think>" not in "".join(t_answers)
    with pytest.raises(ValueError, match="voice 'mine'"):
        assets.conversations(voice="mine")


def test_the_targets_phrases_hold_no_token_of_the_datasets_answers(tmp_path):
    tokenizer = assets.build_tokenizer(tmp_path / "tok")
    dataset_tokens = {i for a in _split(assets.conversations())[1] for i in tokenizer(a)["input_ids"]}
    for phrase in assets._PHRASES:
        # After another sentence; and first in an answer, where its first letter is a token of its own.
        assert not set(tokenizer(" " + phrase)["input_ids"]) & dataset_tokens, phrase
        assert not set(tokenizer(phrase)["input_ids"][1:]) & dataset_tokens, phrase


def test_the_voice_id_names_the_voice_and_changes_with_its_chats():
    assert assets.voice_id("target").startswith("target ")
    assert assets.voice_id("target") != assets.voice_id("dataset") != assets.voice_id("target", seed=1)
