"""The regenerate stage's pure parts: a row's spans and the row its answers rebuild (workers/regenerate/rows.py), the rows files (ledger.py), the plan (settings.py), the counts (assemble.py), and where the run's data lives and where regenerate may sit (state/regenerate.py)."""

from __future__ import annotations

import json
import os

import pytest

from eyas.state.regenerate import data_dir, pipeline_problems, tensor_parallel_size
from eyas.workers.regenerate import assemble, ledger
from eyas.workers.regenerate.rows import MAX_LENGTH, MAX_TOKENS, RowJob, mask_of, request_seed, run_batch, spans
from eyas.workers.regenerate.settings import eos_ids, plan_batches, share

# Token names of a tiny chat: B(os), U(ser header), A(ssistant header), E(nd of turn).
B, U, A, E = 1, 4, 5, 2


def job(ids, mask, **kw) -> RowJob:
    args = {"row": 7, "stop_ids": frozenset({E}), "max_tokens": 8, "max_length": 64, "context": 64}
    return RowJob(ids=list(ids), mask=list(mask), **{**args, **kw})


def test_spans_are_the_runs_of_the_mask_and_mask_of_inverts_them():
    assert spans([0, 1, 1, 0, 1]) == [(1, 3), (4, 5)]
    assert spans([1, 1]) == [(0, 2)]
    assert spans([0, 0]) == []
    for mask in ([0, 1, 1, 0, 1], [1, 0, 0, 1, 1, 1, 0], [0] * 4):
        assert mask_of(len(mask), spans(mask)) == mask


# The end of turn inside the mask (eyas's test template: {% generation %}content<|end|>{% endgeneration %}).
INSIDE_IDS = [B, U, 30, E, A, 40, 41, E, U, 31, E, A, 42, E]
INSIDE_MASK = [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1]


def test_turn_two_is_conditioned_on_the_regenerated_turn_one():
    j = job(INSIDE_IDS, INSIDE_MASK)
    prompt, budget = j.pending()
    assert (prompt, budget) == ([B, U, 30, E, A], 8)
    j.take([90, 91, 92, E], "stop")
    prompt, _ = j.pending()
    # Turn 2's prompt: the regenerated answer, then the original user turn and header.
    assert prompt == [B, U, 30, E, A, 90, 91, 92, E, U, 31, E, A]
    j.take([93, E], "stop")
    assert j.pending() is None and j.done and not j.cut
    assert j.out_ids == [B, U, 30, E, A, 90, 91, 92, E, U, 31, E, A, 93, E]
    # The target's tokens, its stop tokens included (the template trains on <|end|>), are the mask.
    assert j.out_mask == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1]
    assert j.record() == {
        "row": 7,
        "ids": j.out_ids,
        "spans": [[5, 9], [13, 15]],
        "turns": [[4, "stop"], [2, "stop"]],
        "cut": False,
    }


def test_an_end_of_turn_after_the_mask_is_not_doubled():
    # A template that marks only the content: <|end|> follows the span, outside the mask.
    ids = [B, U, 30, A, 40, 41, E, U, 31, A, 42, E]
    mask = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 0]
    j = job(ids, mask)
    j.take([90, E], "stop")
    assert j.pending()[0] == [B, U, 30, A, 90, E, U, 31, A]  # one E: the template's
    j.take([91, 92, E], "stop")
    assert j.out_ids == [B, U, 30, A, 90, E, U, 31, A, 91, 92, E]
    assert j.out_mask == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 0]


def test_what_the_template_writes_after_its_end_inside_the_mask_follows_the_answer():
    # ChatML masked by rendering prefixes: the span is content, <|im_end|> (E) and "\n" (NL).
    NL = 13
    ids = [U, 30, E, NL, A, 40, 41, E, NL, U, 31, E, NL, A, 42, E, NL]
    mask = [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 1]
    j = job(ids, mask, max_tokens=2)
    j.take([90, E], "stop")
    assert j.pending()[0] == [U, 30, E, NL, A, 90, E, NL, U, 31, E, NL, A]  # one E, and its "\n"
    j.take([91, 92], "length")
    assert j.out_ids == [U, 30, E, NL, A, 90, E, NL, U, 31, E, NL, A, 91, 92, E, NL]
    assert j.out_mask == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0]


def test_an_answer_cut_at_max_tokens_gets_the_templates_end_back_at_loss_zero():
    j = job(INSIDE_IDS, INSIDE_MASK, max_tokens=3)
    j.take([90, 91, 92], "length")
    prompt, budget = j.pending()
    assert prompt == [B, U, 30, E, A, 90, 91, 92, E, U, 31, E, A] and budget == 3
    j.take([93, E], "stop")
    assert j.out_mask == [0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]  # that E is the template's
    assert j.record()["turns"] == [[3, MAX_TOKENS], [2, "stop"]]


def test_the_row_never_grows_past_max_length_nor_a_prompt_past_the_context():
    # Room for 6 tokens of answer under max_length 11; the answer fills it: the row ends there.
    j = job(INSIDE_IDS, INSIDE_MASK, max_length=11)
    assert j.pending() == ([B, U, 30, E, A], 6)
    j.take([90, 91, 92, 93, 94, 95], "length")
    assert j.pending() is None and j.cut
    assert j.out_ids == [B, U, 30, E, A, 90, 91, 92, 93, 94, 95]
    assert j.record()["turns"] == [[6, MAX_LENGTH]]
    # The context binds the same way (vLLM's max_model_len < data.max_length).
    assert job(INSIDE_IDS, INSIDE_MASK, context=7).pending() == ([B, U, 30, E, A], 2)
    # A second turn with no room left ends the row with what it has, cut.
    j = job(INSIDE_IDS, INSIDE_MASK, max_length=13)
    j.take([90, 91, 92, E], "stop")
    assert j.pending() is None and j.cut and j.failed is None
    assert j.out_ids == [B, U, 30, E, A, 90, 91, 92, E, U, 31, E, A]
    assert sum(j.out_mask) == 4


def test_a_first_prompt_without_room_fails_the_row_naming_the_bound():
    j = job(INSIDE_IDS, INSIDE_MASK, context=5)
    assert j.pending() is None and j.failed == "prompt_too_long"
    assert j.detail == (
        "its first prompt is 5 tokens and the target's context is 5 tokens (max_model_len): no room for an answer"
    )
    assert j.record() == {"row": 7, "failed": "prompt_too_long", "detail": j.detail}
    assert job([B, U, A], [0, 0, 0]).failed == "no_assistant_tokens"
    # An answer of its end alone, where the template writes the end: nothing left to train on.
    j = job([B, U, 30, A, 40, E], [0, 0, 0, 0, 1, 0])
    j.take([E], "stop")
    assert j.failed == "no_trainable_tokens"


def test_last_only_keeps_the_earlier_answers_as_context():
    j = job(INSIDE_IDS, INSIDE_MASK, last_only=True)
    prompt, _ = j.pending()
    assert prompt == INSIDE_IDS[:12]  # the first answer as the data has it
    j.take([93, E], "stop")
    assert j.out_mask == [0] * 12 + [1, 1]


def test_run_batch_sends_each_turn_of_every_row_together():
    seen = []

    def answer(asks):
        seen.append([(j.row, list(p), b) for j, p, b in asks])
        return [([100 + j.row, E], "stop") for j, _, _ in asks]

    one = job(INSIDE_IDS, INSIDE_MASK, row=0)
    two = job([B, U, 30, E, A, 40, E], [0, 0, 0, 0, 0, 1, 1], row=1)
    assert run_batch([one, two], answer) == 2
    assert [[row for row, _, _ in call] for call in seen] == [[0, 1], [0]]
    assert seen[1][0][1] == [B, U, 30, E, A, 100, E, U, 31, E, A]
    assert two.out_ids == [B, U, 30, E, A, 101, E]


def test_request_seeds_are_fixed_by_seed_row_and_turn():
    assert request_seed(0, 3, 1) == request_seed(0, 3, 1)
    assert len({request_seed(s, r, t) for s in (0, 1) for r in range(20) for t in range(3)}) == 120
    assert all(0 <= request_seed(5, r, 0) < 2**31 for r in range(50))


def test_the_plan_is_the_rows_in_order_and_every_batch_goes_to_one_engine():
    plan = plan_batches(10, 3)
    assert plan == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    lengths = [5, 50, 5, 5, 5, 5, 60, 5, 5, 5]
    shares = [share(plan, lengths, r, 3) for r in range(3)]
    assert sorted(b for s in shares for b in s) == [0, 1, 2, 3]
    assert all(s == sorted(s) for s in shares)
    assert share(plan, lengths, 0, 1) == [0, 1, 2, 3]


def test_eos_ids_read_generation_config_and_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert eos_ids(str(tmp_path), {"eos_token_id": 2}) == [2, 7, 9]
    (tmp_path / "generation_config.json").write_text("{not json")
    assert eos_ids(str(tmp_path), {"text_config": {"eos_token_id": 3}}) == [3]


def test_the_rows_files_ignore_a_torn_line_and_cut_it_before_appending(tmp_path):
    plan = plan_batches(5, 2)
    rec = [{"row": 0, "ids": [1], "spans": [[0, 1]], "turns": [[1, "stop"]], "cut": False}, {"row": 1, "failed": "x"}]
    fd = ledger.open_own(tmp_path, 0)
    ledger.append(fd, 0, rec)
    os.close(fd)
    path = ledger.rank_file(tmp_path, 0)
    with open(path, "ab") as f:
        f.write(b'{"batch": 1, "rows": [{"row": 2')  # a kill mid-write
    # Another rank's line of batch 2, and a line of another plan, which is ignored.
    ledger.rank_file(tmp_path, 1).write_text(
        json.dumps({"batch": 2, "rows": [{"row": 4}]}) + "\n" + json.dumps({"batch": 1, "rows": [{"row": 9}]}) + "\n"
    )
    assert sorted(ledger.finished(tmp_path, plan)) == [0, 2]
    fd = ledger.open_own(tmp_path, 0)
    ledger.append(fd, 1, [{"row": 2}, {"row": 3}])
    os.close(fd)
    assert [json.loads(line)["batch"] for line in path.read_text().splitlines()] == [0, 1]
    assert sorted(ledger.finished(tmp_path, plan)) == [0, 1, 2]


def test_rows_drawn_otherwise_are_never_mixed(tmp_path):
    ledger.claim(tmp_path, {"temperature": 0.0, "seed": 0})
    ledger.claim(tmp_path, {"temperature": 0.0, "seed": 0})
    with pytest.raises(RuntimeError) as err:
        ledger.claim(tmp_path, {"temperature": 0.7, "seed": 0})
    assert str(err.value) == (
        f"{tmp_path}/rows holds rows regenerated otherwise (temperature: 0.0 there, 0.7 now): rows drawn two "
        f"ways are never mixed; restore the setting, or delete {tmp_path}/rows to regenerate every row"
    )


def test_counts_and_the_split_over_the_kept_rows(tmp_path):
    rows = [
        {"row": 0, "ids": [1, 2], "spans": [[1, 2]], "turns": [[1, "stop"]], "cut": False},
        {"row": 1, "failed": "prompt_too_long", "detail": "..."},
        {"row": 2, "ids": [1, 2, 3], "spans": [[1, 3]], "turns": [[2, MAX_TOKENS], [0, "stop"]], "cut": False},
        {"row": 3, "ids": [1, 2], "spans": [[1, 2]], "turns": [[1, MAX_LENGTH]], "cut": True},
    ]
    c = assemble.counts(rows)
    assert {k: c[k] for k in ("rows", "rows_out", "rows_finished", "rows_cut_max_tokens", "rows_cut_max_length")} == {
        "rows": 4,
        "rows_out": 3,
        "rows_finished": 1,
        "rows_cut_max_tokens": 1,
        "rows_cut_max_length": 1,
    }
    assert (c["failed"], c["turns_by_end"], c["tokens_generated"]) == (
        {"prompt_too_long": 1},
        {"stop": 2, MAX_TOKENS: 1, MAX_LENGTH: 1},
        4,
    )
    (tmp_path / "splits.json").write_text(json.dumps({"rows": 4, "seed": 0, "validation": [1, 3]}))
    assert assemble.splits(tmp_path, rows) == {
        "rows": 3,
        "seed": 0,
        "validation": [2],
        "source": "regenerate",
        "rows_left_out": 1,
    }


def test_where_regenerate_sits_and_which_data_a_run_reads(tmp_path):
    assert data_dir(tmp_path, ["prepare", "extract"]) == tmp_path / "prepare"
    assert data_dir(tmp_path, ["prepare", "regenerate", "extract"]) == tmp_path / "regenerate"
    assert data_dir(tmp_path, None) == tmp_path / "prepare"
    assert pipeline_problems(["prepare", "regenerate", "extract", "vocab", "train"]) == []
    assert pipeline_problems(["prepare", "extract", "regenerate", "train"]) == [
        "regenerate comes after extract, which reads its dataset; "
        'e.g. pipeline = ["prepare", "regenerate", "extract", "train"]'
    ]
    assert pipeline_problems(["regenerate", "prepare"]) == [
        "regenerate comes before prepare, whose dataset it rewrites; put prepare first"
    ]
    assert tensor_parallel_size({"extract": {"tensor_parallel_size": 2}, "regenerate": {}}) == 2
    assert (
        tensor_parallel_size({"extract": {"tensor_parallel_size": 2}, "regenerate": {"tensor_parallel_size": 4}}) == 4
    )
