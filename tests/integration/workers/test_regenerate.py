"""The regenerate stage through a real daemon on vLLM's CPU build, with a tiny chat-fitted llama: a multi-turn chat regenerated turn by turn (checked against vLLM answering the same prompts directly), a SIGKILLed rank retried and a SIGKILLed daemon resumed with no row redone or lost and the dataset byte-identical to an uninterrupted run's, and a dataset whose every row fails ending in one line.

Engines take 20-30 s to start here: the uninterrupted run is made once (a module fixture) and
serves as the reference of the others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from daemon_harness import private_daemon, wait_for
from regen_world import END, build_target, chats, columns, regen_toml, rows_lines
from vllm_world import VLLM_ENV

pytestmark = pytest.mark.slow

ROWS = 24  # 12 batches of 2: a kill after the first leaves most of them to do
BATCHES = 12


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    return {"target": build_target(root), "data": chats(root / "chat.jsonl", ROWS), "root": root}


@pytest.fixture(scope="module")
def daemon():
    with private_daemon(grace=5.0, extra_env=VLLM_ENV) as d:
        yield d


@pytest.fixture(scope="module")
def reference(daemon, world):
    """The uninterrupted regeneration every other run is compared with."""
    out = world["root"] / "reference"
    run_id = daemon.submit(regen_toml("reference", out, world["target"], world["data"]), "reference.toml")
    run = daemon.wait_succeeded(run_id, timeout=400)
    return {"out": out, "run": run, "summary": _stage(run, "regenerate")["summary"]}


def _stage(run: dict, name: str) -> dict:
    return {s["name"]: s for s in run["stages"]}[name]


def _attempts(run: dict) -> list[dict]:
    return _stage(run, "regenerate")["attempt_list"]


def test_the_target_rewrites_every_turn_and_counts_them(reference):
    s, out = reference["summary"], reference["out"]
    # The engine's TP worker registered with the daemon (extract's extension), and its lines
    # were split from the driver's into a log of its own.
    (attempt,) = _attempts(reference["run"])
    proc = json.loads((Path(attempt["dir"]) / "tp-0.proc.json").read_text())
    assert (proc["tp_rank"], proc["driver_rank"]) == (0, 0)
    assert f"(Worker_TP0 pid={proc['pid']})" in (Path(attempt["dir"]) / "tp-0.log").read_text()
    assert [(r["rank"], r["role"], r["tp_rank"], r["pid"]) for r in attempt["ranks"]][1:] == [
        (1, "tp-worker", 0, proc["pid"])
    ]
    assert _stage(reference["run"], "regenerate")["tok_s"] > 0  # generated tokens, through the progress file
    assert (s["rows"], s["rows_out"], s["rows_failed"], s["batches"]) == (ROWS, ROWS, 0, BATCHES)
    # The fitted target ends some answers itself and runs past max_tokens on others.
    assert s["rows_finished"] > 0 and s["rows_cut_max_tokens"] > 0
    assert s["rows_finished"] + s["rows_cut_max_tokens"] + s["rows_cut_max_length"] >= ROWS
    assert s["turns_by_end"]["stop"] > 0 and s["turns_by_end"]["max_tokens"] > 0
    assert s["sampling"] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 24,
        "seed": 0,
        "turns": "all",
        "stop_token_ids": [END],
        "max_length": 160,
        "max_model_len": 160,
        "batch_size": 2,
    }
    new, old = columns(out / "regenerate"), columns(out / "prepare")
    assert len(new["input_ids"]) == ROWS and new["input_ids"] != old["input_ids"]
    # The mask is the target's tokens: as many as it generated (a stop token is kept, inside the span).
    assert sum(map(sum, new["loss_mask"])) == s["tokens_generated"] == s["trainable_tokens"]
    assert (
        json.loads((out / "regenerate" / "splits.json").read_text())["validation"]
        == json.loads((out / "prepare" / "splits.json").read_text())["validation"]
    )
    # A multi-turn chat keeps its turns: as many mask runs as the original had.
    runs = lambda m: sum(1 for i, v in enumerate(m) if v and (i == 0 or not m[i - 1]))  # noqa: E731
    assert [runs(m) for m in new["loss_mask"]] == [runs(m) for m in old["loss_mask"]]
    assert max(runs(m) for m in old["loss_mask"]) >= 2


DIRECT = textwrap.dedent(
    """
    import json, sys
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def main():
        job = json.loads(open(sys.argv[1]).read())
        llm = LLM(model=job["target"], skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=False,
                  dtype="float32", max_model_len=job["max_model_len"], seed=0, disable_log_stats=True)
        answers = []
        for turn in job["turns"]:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in turn],
                                [SamplingParams(max_tokens=b, temperature=0.0, detokenize=False) for _, b in turn],
                                use_tqdm=False)
            answers.append([list(o.outputs[0].token_ids) for o in outs])
        print("ANSWERS " + json.dumps(answers), flush=True)

    if __name__ == "__main__":
        main()
    """
)


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_turn_two_is_asked_with_turn_ones_regenerated_answer(reference, world, tmp_path):
    """vLLM, driven directly, answers the batch's turn-1 prompts (prepare's tokens before the
    first answer) as the stage did, and its turn-2 prompts, which hold those answers, as the
    stage did: so the stage asked turn 2 on the regenerated turn 1."""
    new, old = columns(reference["out"] / "regenerate"), columns(reference["out"] / "prepare")
    # The first batch that holds a chat of two turns or more: its rows are sent together, as the stage sends them.
    batch = next(
        [2 * b, 2 * b + 1]
        for b in range(BATCHES)
        if any(len(_spans(old["loss_mask"][r])) >= 2 for r in (2 * b, 2 * b + 1))
    )
    turn1 = [(old["input_ids"][r][: _spans(old["loss_mask"][r])[0][0]], r) for r in batch]
    two = [r for r in batch if len(_spans(old["loss_mask"][r])) >= 2]
    turn2 = [(new["input_ids"][r][: _spans(new["loss_mask"][r])[1][0]], r) for r in two]
    job = {
        "target": str(world["target"]),
        "max_model_len": 160,
        "turns": [[(p, min(24, 160 - len(p))) for p, _ in turn1], [(p, min(24, 160 - len(p))) for p, _ in turn2]],
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "direct.py").write_text(DIRECT)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "direct.py"), str(tmp_path / "job.json")],
        env={**os.environ, **VLLM_ENV},
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in proc.stdout.splitlines() if x.startswith("ANSWERS ")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    first, second = json.loads(line[0].removeprefix("ANSWERS "))
    for (prompt, r), answer in zip(turn1, first, strict=True):
        start, end = _spans(new["loss_mask"][r])[0]
        assert new["input_ids"][r][:start] == prompt
        # The answer takes the first span; cut at max_tokens, the template's <|end|> follows at loss 0.
        assert new["input_ids"][r][start:end] == answer
        if answer[-1] != END:
            assert new["input_ids"][r][end] == END and new["loss_mask"][r][end] == 0
    for (prompt, r), answer in zip(turn2, second, strict=True):
        a1 = first[batch.index(r)]
        start1 = _spans(new["loss_mask"][r])[0][0]
        assert prompt[start1 : start1 + len(a1)] == a1  # turn 2's prompt holds turn 1's answer...
        assert a1 != old["input_ids"][r][start1 : start1 + len(a1)]  # ...which is not the dataset's
        start, end = _spans(new["loss_mask"][r])[1]
        assert new["input_ids"][r][start:end] == answer


def _kill_after_first_batch(daemon, run_id: int, out: Path) -> list[dict]:
    """Wait until the rank has written a batch (and not all), SIGKILL its driver; the lines then."""
    wait_for(lambda: rows_lines(out), 300, 0.02, "the first regenerated batch")
    (rank,) = [r for r in daemon.ranks(run_id, "regenerate") if r["rank"] == 0]
    os.kill(rank["pid"], signal.SIGKILL)
    time.sleep(0.5)  # the driver is gone: its file is final
    lines = rows_lines(out)
    assert 0 < len(lines) < BATCHES, f"the kill came after {len(lines)} of {BATCHES} batches"
    return lines


def _assert_resumed(daemon, run: dict, reference: dict, out: Path, before: list[dict]) -> None:
    attempts = _attempts(run)
    assert [a["state"] for a in attempts] == ["failed", "succeeded"]
    done_before = {line["batch"] for line in before}
    # The second attempt generated only what the first had not written, and said so.
    assert _stage(run, "regenerate")["summary"]["attempt"] == {
        "rows_generated": ROWS - 2 * len(done_before),
        "tokens_generated": _stage(run, "regenerate")["summary"]["attempt"]["tokens_generated"],
        "batches_run": BATCHES - len(done_before),
        "batches_skipped": len(done_before),
        "rows_resumed": 2 * len(done_before),
    }
    # Every batch once in the rows files: none redone, none lost.
    assert sorted(line["batch"] for line in rows_lines(out)) == list(range(BATCHES))
    # Byte for byte the uninterrupted run's rows (the arrow files themselves), counts and token frequencies.
    assert columns(out / "regenerate") == columns(reference["out"] / "regenerate")
    arrow = lambda o: [p.read_bytes() for p in sorted((o / "regenerate" / "dataset").glob("*.arrow"))]  # noqa: E731
    assert arrow(out) == arrow(reference["out"]) and arrow(out)
    assert (out / "regenerate" / "token_freq.npy").read_bytes() == (
        reference["out"] / "regenerate" / "token_freq.npy"
    ).read_bytes()
    mine = {k: v for k, v in _stage(run, "regenerate")["summary"].items() if k not in ("attempt", "outputs", "source")}
    ref = {k: v for k, v in reference["summary"].items() if k not in ("attempt", "outputs", "source")}
    assert mine == ref


def test_a_killed_rank_retried_redoes_no_row_and_matches_the_uninterrupted_run(daemon, world, reference):
    out = world["root"] / "killed-rank"
    run_id = daemon.submit(regen_toml("killed-rank", out, world["target"], world["data"]), "killed-rank.toml")
    before = _kill_after_first_batch(daemon, run_id, out)
    failed = daemon.wait_run(run_id, timeout=120)
    assert failed["state"] == "failed" and _attempts(failed)[0]["root_cause"]["type"] == "SIGKILL"
    retry = daemon.cli("retry", run_id)
    assert retry.returncode == 0, retry.stderr
    _assert_resumed(daemon, daemon.wait_succeeded(run_id, timeout=400), reference, out, before)


def test_a_killed_daemon_then_resume_redoes_no_row(daemon, world, reference):
    out = world["root"] / "killed-daemon"
    run_id = daemon.submit(regen_toml("killed-daemon", out, world["target"], world["data"]), "killed-daemon.toml")
    wait_for(lambda: rows_lines(out), 300, 0.02, "the first regenerated batch")
    ranks = daemon.ranks(run_id, "regenerate")
    daemon.kill9()
    # The machine's crash, as far as the ranks go: they die while no daemon watches them.
    for r in ranks:
        if r["rank"] == 0:
            os.kill(r["pid"], signal.SIGKILL)
    time.sleep(0.5)
    before = rows_lines(out)
    assert 0 < len(before) < BATCHES, f"the kill came after {len(before)} of {BATCHES} batches"
    daemon.start()
    failed = daemon.wait_run(run_id, timeout=120)
    assert failed["state"] == "failed", failed["reason"]
    resume = daemon.cli("resume", run_id)
    assert resume.returncode == 0, resume.stderr
    _assert_resumed(daemon, daemon.wait_succeeded(run_id, timeout=400), reference, out, before)


def test_every_row_failing_ends_in_one_line_without_loading_the_target(daemon, world):
    out = world["root"] / "too-long"
    data = chats(world["root"] / "six.jsonl", 6, seed=5)
    toml = regen_toml("too-long", out, world["target"], data, options={"vllm": {"max_model_len": 8}})
    run_id = daemon.submit(toml, "too-long.toml")
    run = daemon.wait_run(run_id, timeout=120)
    assert run["state"] == "failed"
    (attempt,) = _attempts(run)
    line = (
        "all 6 rows failed: 6 prompts leave no room for an answer in the target's context of 8 tokens "
        "(max_model_len); raise [stages.regenerate] options.vllm.max_model_len (at most the target's "
        "max_position_embeddings) or shorten the prompts"
    )
    root = attempt["root_cause"]
    assert (root["type"], root["message"]) == ("eyas.workers.regenerate.assemble.RegenerateFailed", line)
    assert run["reason"].endswith(line) and "\n" not in run["reason"], run["reason"]
    # No engine was started for it, and nothing that looks complete was published.
    log = Path(attempt["ranks"][0]["log_path"]).read_text()
    assert "engine up" not in log and "tp-0.proc.json" not in os.listdir(attempt["dir"])
    assert not (out / "regenerate" / "summary.json").exists()
