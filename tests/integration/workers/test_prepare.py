"""The prepare stage: input forms, skip reasons, assistant masks, outputs; real files, the real
tokenizer and template of the tiny test target, and one run through a real daemon."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import datasets
import numpy as np
import prepare_harness
import pytest
from daemon_harness import daemon  # noqa: F401 (fixture)
from prepare_harness import run_prepare, write_huge_line_dataset
from runtoml import run_toml

from eyas.state.drafttables import DraftConfig, TrainConfig
from eyas.state.inputtables import DataConfig, TargetConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.data.chat import MaskedRenderer, TemplateMismatch, load_tokenizer
from eyas.workers.data.reader import SKIP_REASONS, DataError
from eyas.workers.doctor.tokenizer import spans
from eyas.workers.models import assets
from eyas.workers.stages import prepare

END = "<|end|>"
ROLE = {"human": "user", "gpt": "assistant", "system": "system"}

# The test template without {% generation %}: masks must come from rendering prefixes.
NO_GEN = assets.CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# Drops the reasoning of every assistant turn but the last (as Qwen3's template does): the
# history re-renders differently once a later turn follows.
STRIP_HISTORY = NO_GEN.replace(
    "{{ message['content'] }}<|end|>{% endif %}{% endfor %}",
    "{% if loop.last %}{{ message['content'] }}{% else %}{{ message['content'].split('</think>')[-1] }}{% endif %}"
    "<|end|>{% endif %}{% endfor %}",
)
# Its generation prompt pre-fills <think> (as DeepSeek-R1's does).
SCAFFOLD = NO_GEN.replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}",
)
# Raises on one content, as templates do on roles that do not alternate.
RAISING = (
    "{% for m in messages %}{% if m['content'] == 'BOOM' %}{{ raise_exception('no booms') }}{% endif %}"
    "{% endfor %}" + assets.CHAT_TEMPLATE
)


# --- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Path:
    """The tiny DeepseekV3 target (weights, config.json, tokenizer with the generation template)."""
    return assets.build_model(tmp_path_factory.mktemp("assets") / "tiny-deepseek", "deepseek_v3")


@pytest.fixture(scope="session")
def tokenizer(tiny):
    return load_tokenizer(str(tiny), False)


@pytest.fixture(scope="session")
def variant(tiny, tmp_path_factory):
    """A copy of the tiny target's config and tokenizer with another chat template."""
    made = {}

    def make(name: str, template: str | None) -> Path:
        if name not in made:
            out = tmp_path_factory.mktemp(name)
            for f in tiny.iterdir():
                if f.name not in ("model.safetensors", "chat_template.jinja"):
                    shutil.copy(f, out / f.name)
            if template is not None:
                (out / "chat_template.jinja").write_text(template)
            made[name] = out
        return made[name]

    return make


def messages(conv: dict) -> list[dict]:
    return [{"role": ROLE[t["from"]], "content": t["value"]} for t in conv["conversations"]]


def config(
    target: Path,
    data: Path,
    fmt: str = "auto",
    max_length: int = 256,
    limit: int = 0,
    fraction: float = 0.1,
    seed: int = 0,
) -> dict:
    return RunConfig(
        name="t",
        target=TargetConfig(path=str(target), dtype="float32"),
        data=DataConfig(path=str(data), format=fmt, max_length=max_length, limit=limit, validation_fraction=fraction),
        draft=DraftConfig(vocab_size=64),
        train=TrainConfig(seed=seed),
    ).to_dict()


def rows_of(out: Path) -> list[tuple[list[int], list[int]]]:
    ds = datasets.load_from_disk(str(out / "prepare" / "dataset")).with_format(None)
    return list(zip(ds["input_ids"], ds["loss_mask"]))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the main path --------------------------------------------------------------------------


def test_sharegpt_jsonl_with_malformed_rows(tiny, tokenizer, tmp_path):
    data = assets.write_dataset(tmp_path / "chat.jsonl", n=60, seed=3)
    summary = run_prepare(config(tiny, data, fraction=0.1, seed=7), tmp_path / "out")
    stage = tmp_path / "out" / "prepare"
    assert summary == {
        "rows_in": 66,
        "rows_out": 60,
        "skipped": {r: 1 for r in SKIP_REASONS if r in assets.MALFORMED_LINES},
        "skipped_total": 6,
        "truncated": 0,
        "tokens": summary["tokens"],
        "trainable_tokens": summary["trainable_tokens"],
        "validation_rows": 6,
        "mask_method": {"generation": 60},
        "max_length": 256,
        "row_byte_limit": 2**20,
        "target_vocab_size": 512,
        "data_path": str(data),
        "data_files": 1,
        "outputs": [str(stage / "dataset"), str(stage / "token_freq.npy"), str(stage / "splits.json")],
    }
    assert list(summary["skipped"]) == [r for r in SKIP_REASONS if r in assets.MALFORMED_LINES]
    # The stage folder's summary.json (written last) is the same record.
    assert json.loads((stage / "summary.json").read_text()) == summary

    # Every row is the rendered conversation, in input order.
    renderer = MaskedRenderer(tokenizer)
    expected = [renderer.render(messages(c)) for c in assets.conversations(60, 3)]
    got = rows_of(tmp_path / "out")
    assert got == [(list(ids), list(mask)) for ids, mask in expected]
    assert summary["tokens"] == sum(len(ids) for ids, _ in got)
    assert summary["trainable_tokens"] == sum(sum(mask) for _, mask in got)

    # speculators' columns and types; the torch format as speculators saves it.
    ds = datasets.load_from_disk(str(stage / "dataset"))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert ds.features == datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    assert ds.format["type"] == "torch"
    assert ds.with_format(None)["seq_len"] == [len(ids) for ids, _ in got]

    # Token frequencies equal a recount over the loss-masked positions.
    freq = np.load(stage / "token_freq.npy", allow_pickle=False)
    assert (freq.dtype, freq.shape) == (np.int64, (512,))
    recount = np.zeros(512, dtype=np.int64)
    for ids, mask in got:
        for t, m in zip(ids, mask):
            recount[t] += m
    assert np.array_equal(freq, recount)
    assert freq.sum() == summary["trainable_tokens"]

    splits = json.loads((stage / "splits.json").read_text())
    assert splits == {
        "rows": 60,
        "validation_fraction": 0.1,
        "seed": 7,
        "validation": prepare.validation_rows(60, 0.1, 7),
    }
    assert len(splits["validation"]) == 6

    # Progress counts rows processed; the last line has the final totals.
    progress = tmp_path / "out/attempts/attempt-1/rank-0.progress.jsonl"
    records = [json.loads(x) for x in progress.read_text().splitlines()]
    lines = [r for r in records if "heartbeat" not in r]  # heartbeats carry no counts
    phases = [r["heartbeat"] for r in records if "heartbeat" in r and not r.get("ended")]
    assert list(dict.fromkeys(phases)) == ["count rows", "save dataset", "publish dataset"]
    assert [r["heartbeat"] for r in records if r.get("ended")] == ["count rows", "save dataset", "publish dataset"]
    assert (lines[-1]["samples"], lines[-1]["samples_total"], lines[-1]["tokens"]) == (66, 66, summary["tokens"])
    assert lines[0]["samples_total"] == 66


def test_every_input_form_gives_the_same_rows(tiny, tmp_path):
    convs = assets.conversations(12, seed=11)
    forms = tmp_path / "forms"
    forms.mkdir()
    sharegpt = write_jsonl(forms / "sharegpt.jsonl", convs)
    array = forms / "sharegpt.json"
    array.write_text(json.dumps(convs, indent=2))
    openai = write_jsonl(forms / "openai.jsonl", [{"messages": messages(c)} for c in convs])
    split = lambda text: [{"type": "text", "text": text[:5]}, {"type": "text", "text": text[5:]}]  # noqa: E731
    parts = write_jsonl(
        forms / "parts.jsonl",
        [{"messages": [{"role": m["role"], "content": split(m["content"])} for m in messages(c)]} for c in convs],
    )
    folder = tmp_path / "folder"  # read in sorted order: a-*.jsonl, then b-*.json
    folder.mkdir()
    write_jsonl(folder / "a-first.jsonl", convs[:5])
    (folder / "b-rest.json").write_text(json.dumps([{"messages": messages(c)} for c in convs[5:]]))

    reference = run_prepare(config(tiny, sharegpt, fmt="sharegpt"), tmp_path / "ref")
    want = rows_of(tmp_path / "ref")
    assert reference["rows_out"] == 12 and reference["mask_method"] == {"generation": 12}
    for name, path, fmt in (
        ("array", array, "auto"),
        ("openai", openai, "openai"),
        ("parts", parts, "auto"),
        ("folder", folder, "auto"),
    ):
        summary = run_prepare(config(tiny, path, fmt=fmt), tmp_path / name)
        assert (summary["rows_in"], summary["rows_out"], summary["skipped"]) == (12, 12, {}), name
        assert rows_of(tmp_path / name) == want, name

    # Pre-tokenized rows pass through as given.
    tokenized = write_jsonl(forms / "tokens.jsonl", [{"input_ids": i, "loss_mask": m} for i, m in want])
    summary = run_prepare(config(tiny, tokenized, fmt="tokenized"), tmp_path / "tok")
    assert summary["mask_method"] == {"pretokenized": 12}
    assert rows_of(tmp_path / "tok") == want


def test_openai_messages_with_system_turn_and_reasoning(tiny, tokenizer, variant, tmp_path):
    """The exact masked spans: each assistant content, <think> reasoning included, plus <|end|>."""
    answers = ["<think>two plus three is five</think>Five.", "<think>five plus four</think>Nine, I think."]
    conv = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Add two and three."},
        {"role": "assistant", "content": answers[0]},
        {"role": "user", "content": "And four more?"},
        {"role": "assistant", "content": answers[1]},
    ]
    data = write_jsonl(tmp_path / "one.jsonl", [{"messages": conv}])
    for name, target in (("generation", tiny), ("prefix", variant("nogen", NO_GEN))):
        summary = run_prepare(config(target, data), tmp_path / name)
        assert summary["mask_method"] == {name: 1}
        ((ids, mask),) = rows_of(tmp_path / name)
        assert tokenizer.decode(ids) == (
            "<|bos|><|system|>You are terse.<|end|><|user|>Add two and three.<|end|>"
            f"<|assistant|>{answers[0]}<|end|><|user|>And four more?<|end|>"
            f"<|assistant|>{answers[1]}<|end|>"
        )
        assert [tokenizer.decode(ids[a:b]) for a, b in spans(mask)] == [a + END for a in answers], name
        think = tokenizer.convert_tokens_to_ids("<think>")
        assert [m for t, m in zip(ids, mask) if t == think] == [1, 1]


def test_prefix_masks_equal_generation_masks(tokenizer):
    generation = MaskedRenderer(tokenizer)
    prefix = MaskedRenderer(tokenizer, template=NO_GEN)
    assert (generation.method, prefix.method) == ("generation", "prefix")
    convs = [messages(c) for c in assets.conversations(150, seed=0)]
    assert any(m["content"].startswith("<think>") for c in convs for m in c[:-1])  # reasoning in history too
    for conv in convs:
        assert prefix.render(conv) == generation.render(conv)


def test_prefilled_generation_prompt_falls_back_to_the_common_prefix(tokenizer):
    renderer = MaskedRenderer(tokenizer, template=SCAFFOLD)
    conv = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "<think>greet</think>Hello."},
        {"role": "user", "content": "Bye."},
        {"role": "assistant", "content": "Goodbye."},
    ]
    ids, mask = renderer.render(conv)
    # The pre-filled <think> belongs to the prompt; a turn without it is masked from its start.
    assert [tokenizer.decode(ids[a:b]) for a, b in spans(mask)] == ["greet</think>Hello." + END, "Goodbye." + END]


def test_template_that_rewrites_history_is_refused_naming_the_turn(tokenizer, variant, tmp_path):
    conv = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "<think>greet</think>Hello."},
        {"role": "user", "content": "Bye."},
        {"role": "assistant", "content": "Goodbye."},
    ]
    with pytest.raises(TemplateMismatch) as info:
        MaskedRenderer(tokenizer, template=STRIP_HISTORY).render(conv)
    assert info.value.turn == 2
    assert "turn 2 (assistant): it renders differently once later turns follow" in str(info.value)
    assert "{% generation %}" in str(info.value)
    # A single reasoning turn re-renders the same: only history rewriting is refused.
    ids, mask = MaskedRenderer(tokenizer, template=STRIP_HISTORY).render(conv[:3])
    assert [tokenizer.decode(ids[a:b]) for a, b in spans(mask)] == ["<think>greet</think>Hello." + END]

    # Through the stage: it stops at the row, names it and the turn, and publishes nothing.
    good = [{"messages": conv[:3]}, {"messages": conv[1:2] + conv[3:]}]
    data = write_jsonl(tmp_path / "bad.jsonl", good + [{"messages": conv}] + good)
    with pytest.raises(
        TemplateMismatch, match=r"^bad\.jsonl:3: the chat template re-renders the conversation at turn 2"
    ):
        run_prepare(config(variant("strip", STRIP_HISTORY), data), tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "prepare").iterdir()) == []


def test_truncation_and_rows_without_trainable_tokens(tiny, tokenizer, tmp_path):
    convs = [messages(c) for c in assets.conversations(30, seed=7)]
    convs += [
        [
            {"role": "user", "content": " ".join(["count the red stones"] * 12)},  # assistant past the cut
            {"role": "assistant", "content": "Twelve."},
        ],
        [{"role": "system", "content": "Only a system turn and a question."}, {"role": "user", "content": "Why?"}],
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    renderer = MaskedRenderer(tokenizer)
    full = [renderer.render(c) for c in convs]
    kept = [(ids[:32], mask[:32]) for ids, mask in full if any(mask[:32])]
    cut = sum(1 for ids, mask in full if len(ids) > 32 and any(mask[:32]))
    dropped = len(full) - len(kept)
    assert cut >= 5 and dropped >= 2  # both cases really occur

    summary = run_prepare(config(tiny, data, max_length=32), tmp_path / "out")
    assert (summary["rows_in"], summary["rows_out"], summary["truncated"]) == (32, len(kept), cut)
    assert summary["skipped"] == {"no_trainable_tokens": dropped}
    assert summary["mask_method"] == {"generation": len(kept)}  # rows kept, by how they were masked
    assert rows_of(tmp_path / "out") == kept
    assert max(len(ids) for ids, _ in kept) == 32


def test_each_skip_reason_is_counted_exactly(variant, tmp_path, caplog):
    good = [{"conversations": c["conversations"]} for c in assets.conversations(10, seed=5)]
    chat = lambda *turns: {"messages": [{"role": r, "content": c} for r, c in turns]}  # noqa: E731
    ok = ("assistant", "ok")
    bad: list[tuple[str, bytes]] = list(assets.MALFORMED_LINES.items())
    bad += [
        (reason, json.dumps(row).encode() + b"\n")
        for reason, row in [
            ("wrong_type", [1, 2]),
            ("wrong_type", {"conversations": "hi"}),
            ("wrong_type", {"messages": [["user", "hi"]]}),
            ("wrong_type", {"messages": [{"role": 7, "content": "x"}]}),
            ("wrong_type", {"input_ids": [1, True], "loss_mask": [0, 1]}),
            ("wrong_type", {"input_ids": [1, 2], "loss_mask": [0, 2]}),
            (
                "wrong_type",
                {
                    "messages": [
                        {"role": "user", "content": [{"type": "image", "url": "x.png"}]},
                        {"role": "assistant", "content": "ok"},
                    ]
                },
            ),
            ("missing_field", {"text": "hello"}),
            ("missing_field", {"input_ids": [1, 2]}),
            ("empty_conversation", {"conversations": []}),
            ("missing_role", {"messages": [{"content": "x"}, {"role": "assistant", "content": "ok"}]}),
            ("unknown_role", chat(("tool", "42"), ok)),
            ("empty_content", chat(("user", "   "), ok)),
            ("empty_content", chat(("user", None), ok)),
            ("empty_content", {"conversations": [{"from": "human"}, {"from": "gpt", "value": "ok"}]}),
            ("empty_content", {"input_ids": [], "loss_mask": []}),
            ("length_mismatch", {"input_ids": [1, 2, 3], "loss_mask": [0, 1]}),
            ("token_out_of_range", {"input_ids": [1, 512], "loss_mask": [0, 1]}),
            ("token_out_of_range", {"input_ids": [-1, 5], "loss_mask": [0, 1]}),
            ("template_error", chat(("user", "BOOM"), ok)),
            ("no_trainable_tokens", chat(("user", "Only a question?"))),
            ("no_trainable_tokens", {"input_ids": [1, 2, 3], "loss_mask": [0, 0, 0]}),
        ]
    ]
    # Over the row byte limit (1 MiB at max_length 256): skipped unread, whatever it holds.
    bad += [("too_long", json.dumps(chat(("user", "x" * 2**20), ok)).encode() + b"\n")]
    bad += [
        ("invalid_json", b'{"messages": [}\n'),
        ("invalid_json", b'{"a": ' + b"[" * 10**5 + b"]" * 10**5 + b"}\n"),
        (
            "not_utf8",
            b'{"messages": [{"role": "user", "content": "caf\\udce9"}, {"role": "assistant", "content": "ok"}]}\n',
        ),
    ]
    lines = []
    for i, row in enumerate(good):  # bad lines between good ones, blank lines too
        lines.append(json.dumps(row).encode() + b"\n")
        lines += [line for _, line in bad[i :: len(good)]]
        lines.append(b"\n")
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_bytes(b"".join(lines))
    # A JSON array: a stray byte stays inside its own row; a non-object row is the wrong type.
    # An element over the row byte limit is skipped before it is rendered.
    (folder / "b.json").write_bytes(
        b"[" + json.dumps(good[0]).encode() + b', 5, {"conversations": [{"from": "human", '
        b'"value": "caf\xe9"}, {"from": "gpt", "value": "ok"}]}, '
        + json.dumps(chat(("user", "y" * 2**20), ok)).encode()
        + b"]"
    )
    expected: dict[str, int] = {}
    for reason in [r for r, _ in bad] + ["wrong_type", "not_utf8", "too_long"]:
        expected[reason] = expected.get(reason, 0) + 1
    assert set(expected) == set(SKIP_REASONS)  # every reason is exercised

    with caplog.at_level(logging.WARNING, logger="eyas.prepare"):
        summary = run_prepare(config(variant("raising", RAISING), folder), tmp_path / "out")
    assert summary["skipped"] == expected
    assert list(summary["skipped"]) == list(SKIP_REASONS)
    assert (summary["rows_in"], summary["rows_out"], summary["skipped_total"]) == (len(bad) + 14, 11, len(bad) + 3)
    logged = caplog.text
    assert "skipped b.json[2] (not_utf8): turn 0's content holds a character that is not UTF-8 text at 3" in logged
    assert "(template_error): TemplateError: no booms" in logged
    # Three examples per reason, then only counts.
    assert logged.count("(wrong_type): ") == 3 and "any further wrong_type rows are counted, not logged" in logged


def test_limit_counts_kept_rows(tiny, tmp_path):
    data = assets.write_dataset(tmp_path / "chat.jsonl", n=30, seed=2)
    run_prepare(config(tiny, data), tmp_path / "all")
    summary = run_prepare(config(tiny, data, limit=10), tmp_path / "ten")
    lines = data.read_bytes().splitlines()
    good = [i for i, line in enumerate(lines) if line in {json.dumps(c).encode() for c in assets.conversations(30, 2)}]
    assert summary["rows_out"] == 10
    assert summary["rows_in"] == good[9] + 1  # reading stops once 10 rows are kept
    assert rows_of(tmp_path / "ten") == rows_of(tmp_path / "all")[:10]


def test_validation_rows():
    picked = prepare.validation_rows(200, 0.05, 0)
    assert len(picked) == 10 and picked == sorted(set(picked)) and all(0 <= i < 200 for i in picked)
    assert prepare.validation_rows(200, 0.05, 0) == picked
    assert prepare.validation_rows(200, 0.05, 1) != picked
    assert prepare.validation_rows(200, 0.0, 0) == []
    assert prepare.validation_rows(1, 0.5, 0) == []
    assert len(prepare.validation_rows(10, 0.01, 0)) == 1  # a fraction > 0 holds out at least one row
    assert len(prepare.validation_rows(10, 1.0, 0)) == 9  # and always leaves one to train on


def test_retry_replaces_a_complete_output_only_when_done(tiny, variant, tmp_path):
    out = tmp_path / "out"
    stage = out / "prepare"
    run_prepare(config(tiny, assets.write_dataset(tmp_path / "a.jsonl", n=20, seed=1)), out)
    before = {p.relative_to(stage): p.read_bytes() for p in stage.rglob("*") if p.is_file()}
    assert {str(p) for p in before} >= {"summary.json", "token_freq.npy", "splits.json", "dataset/state.json"}

    # An attempt that fails mid-way (row 3 hits a template that rewrites history).
    conv = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "<think>x</think>Hello."},
        {"role": "user", "content": "Bye."},
        {"role": "assistant", "content": "Bye."},
    ]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": conv[:2]}] * 2 + [{"messages": conv}])
    with pytest.raises(TemplateMismatch):
        run_prepare(config(variant("strip", STRIP_HISTORY), bad), out, attempt=2)
    assert {p.relative_to(stage): p.read_bytes() for p in stage.rglob("*") if p.is_file()} == before

    # A crashed attempt's temp folder is cleared; the next one replaces everything.
    (stage / ".prepare-tmp-2-999" / "dataset").mkdir(parents=True)
    summary = run_prepare(
        config(tiny, assets.write_dataset(tmp_path / "b.jsonl", n=8, seed=4, malformed=False)), out, attempt=3
    )
    assert summary["rows_out"] == 8
    assert sorted(p.name for p in stage.iterdir()) == ["dataset", "splits.json", "summary.json", "token_freq.npy"]
    assert len(rows_of(out)) == 8
    assert json.loads((stage / "summary.json").read_text()) == summary


def test_unusable_input_fails_with_a_clear_message(tiny, variant, tmp_path):
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(assets.MALFORMED_LINES["invalid_json"] + assets.MALFORMED_LINES["wrong_type"])
    with pytest.raises(
        ValueError,
        match=r"no usable rows in .*junk\.jsonl \(2 read, skipped: "
        r"\{'invalid_json': 1, 'wrong_type': 1\}\); fix the data",
    ):
        run_prepare(config(tiny, junk), tmp_path / "o1")
    broken = tmp_path / "broken.json"
    broken.write_text('[{"messages": []},\n {"messages": ]')
    with pytest.raises(
        DataError, match=r"broken\.json: line 2, column \d+: not valid JSON .*write one JSON object per line"
    ):
        run_prepare(config(tiny, broken), tmp_path / "o2")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="holds no .json or .jsonl file"):
        run_prepare(config(tiny, empty), tmp_path / "o3")
    chats = assets.write_dataset(tmp_path / "chat.jsonl", n=3, malformed=False)
    with pytest.raises(ValueError, match="the tokenizer has no chat template; add one"):
        run_prepare(config(variant("notemplate", None), chats), tmp_path / "o4")


def test_pretokenized_rows_match_speculators_passthrough(tiny, tokenizer, tmp_path):
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    renderer = MaskedRenderer(tokenizer)
    rows = [dict(zip(("input_ids", "loss_mask"), renderer.render(messages(c)))) for c in assets.conversations(20, 9)]
    rows.append({"input_ids": [1, 4, 40, 41, 2], "loss_mask": [0, 0, 0, 0, 0]})
    data = write_jsonl(tmp_path / "tok.jsonl", rows)
    summary = run_prepare(config(tiny, data, max_length=40), tmp_path / "out")
    ours = datasets.load_from_disk(str(tmp_path / "out/prepare/dataset"))
    theirs = build_speculator_training_dataset(datasets.Dataset.from_list(rows), tokenizer, max_length=40, num_proc=1)
    assert ours.features == theirs.features
    assert ours.format["type"] == theirs.format["type"] == "torch"
    assert ours.with_format(None)[:] == theirs.with_format(None)[:]
    assert summary["truncated"] >= 3 and summary["skipped"] == {"no_trainable_tokens": 1}


def test_data_stages_through_the_daemon(daemon, tiny, tmp_path):  # noqa: F811
    """prepare → extract (2 ranks) → vocab as rank groups under a real daemon."""
    data = assets.write_dataset(tmp_path / "chat.jsonl")
    toml = run_toml(
        "prep",
        ["prepare", "extract", "vocab"],
        target={"path": tiny, "dtype": "float32"},
        data={"path": data, "max_length": 256, "validation_fraction": 0.1},
        extract={"batch_size": 8},
        draft={"vocab_size": 256},
        resources={"ranks": 2, "devices": "cpu"},
    )
    run_id = daemon.submit(toml)
    run = daemon.wait_run(run_id, timeout=180)
    assert run["state"] == "succeeded", run
    shown = daemon.cli("show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    stages = {s["name"]: s for s in json.loads(shown.stdout)["stages"]}
    prep, vocab = stages["prepare"]["summary"], stages["vocab"]["summary"]
    out = Path(run["output_dir"])
    assert (prep["rows_in"], prep["rows_out"], prep["skipped_total"]) == (306, 300, 6)
    assert prep["skipped"] == {r: 1 for r in SKIP_REASONS if r in assets.MALFORMED_LINES}
    assert prep["outputs"] == [str(out / "prepare" / n) for n in ("dataset", "token_freq.npy", "splits.json")]
    assert vocab["outputs"] == [str(out / "vocab" / "d2t-256.npy"), str(out / "vocab" / "t2d-256.npy")]
    assert (vocab["draft_vocab_size"], vocab["target_vocab_size"], vocab["cached"]) == (256, 512, False)
    extract = stages["extract"]
    assert [r["rank"] for r in extract["attempt_list"][0]["ranks"]] == [0, 1]
    assert (extract["summary"]["samples"], extract["summary"]["tokens"]) == (300, prep["tokens"])
    files = sorted((out / "extract" / "hidden_states").glob("hs_*.safetensors"))
    assert len(files) == 300 and (out / "extract" / "data_config.json").exists()
    assert np.load(out / "vocab" / "t2d-256.npy", allow_pickle=False).sum() == 256
    log = Path(stages["prepare"]["attempt_list"][0]["ranks"][0]["log_path"]).read_text()
    assert "prepare: 306 rows in, 300 out; skipped 6" in log
    human = daemon.cli("show", run_id)
    assert f"prepare: {out / 'prepare' / 'dataset'}" in human.stdout


# --- a row far over max_length: skipped unread, memory bounded ------------------------------

# The child's own peak: VmHWM belongs to its address space, while getrusage's ru_maxrss keeps,
# across exec, the high-water mark of the pytest process it was forked from (1.5 GB late in a
# full run), which is not prepare's memory.
_PREPARE_IN_A_CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from prepare_harness import run_prepare
from pathlib import Path
t0 = time.monotonic()
summary = run_prepare(json.loads(sys.argv[2]), Path(sys.argv[3]))
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"summary": summary, "seconds": time.monotonic() - t0,
                  "peak_rss": int(hwm.split()[1]) * 1024}))
"""


def test_a_200_mb_row_is_skipped_unread_and_memory_stays_bounded(tiny, tmp_path):
    """Before rows were bounded, prepare rendered and tokenised such a row whole: 22.4 GB RSS and
    an OOM kill after 6 min 46 s. Now it is counted as too_long without being held whole."""
    import subprocess
    import sys

    good = assets.conversations(5, seed=8)
    data = tmp_path / "huge.jsonl"
    huge = 200 * 10**6
    write_huge_line_dataset(data, good, huge)
    try:
        assert data.stat().st_size > huge
        cfg = config(tiny, data, max_length=256)
        p = subprocess.run(
            [
                sys.executable,
                "-c",
                _PREPARE_IN_A_CHILD,
                str(Path(prepare_harness.__file__).parent),
                json.dumps(cfg),
                str(tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-3000:]
        result = json.loads(p.stdout.splitlines()[-1])
    finally:
        data.unlink()
    summary = result["summary"]
    assert (summary["rows_in"], summary["rows_out"], summary["skipped"]) == (6, 5, {"too_long": 1})
    assert summary["row_byte_limit"] == 2**20
    # The five good rows, in order, as if the huge one had never been there.
    rows = rows_of(tmp_path / "out")
    renderer = MaskedRenderer(load_tokenizer(str(tiny), False))
    assert rows == [tuple(map(list, renderer.render(messages(c)))) for c in good]
    log = p.stderr
    assert f"skipped huge.jsonl:3 (too_long): {huge} bytes of JSON, over the 1048576-byte limit" in log
    print(
        f"prepare with a {huge / 1e6:.0f} MB row: peak RSS {result['peak_rss'] / 2**20:.0f} MiB, "
        f"{result['seconds']:.1f} s"
    )
    assert result["peak_rss"] < 2**30
