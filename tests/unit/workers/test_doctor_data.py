"""`eyas doctor`'s data checks on real files: what prepare would refuse fails, what it would
partly skip warns, each with a one-line fix; a good file passes."""

from __future__ import annotations

import json
from pathlib import Path

from prepare_harness import write_huge_line_dataset

from eyas.state.inputtables import DataConfig
from eyas.workers.data.reader import ARRAY_MAX_BYTES
from eyas.workers.doctor import data as doctor_data
from eyas.workers.models import assets

CHAT = {"messages": [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."}]}


def run(path: Path, fmt: str = "auto", max_length: int = 256) -> dict[str, tuple[str, str, str]]:
    checks = doctor_data.check(DataConfig(path=str(path), format=fmt, max_length=max_length))
    assert all(c.group == "data" for c in checks)
    return {c.name: (c.verdict, c.detail, c.fix) for c in checks}


def test_a_good_file_passes(tmp_path):
    data = assets.write_dataset(tmp_path / "chat.jsonl", n=40, malformed=False)
    ((name, (verdict, detail, _)),) = run(data).items()
    assert (name, verdict) == ("rows", "pass")
    assert detail.startswith("1 file, ") and '32 sampled rows parse as data.format "auto"' in detail
    assert "no row over 1048576 bytes" in detail


def test_a_200_mb_line_warns(tmp_path):
    data = tmp_path / "huge.jsonl"
    write_huge_line_dataset(data, assets.conversations(5, seed=8), 200 * 10**6)
    try:
        found = run(data)
    finally:
        data.unlink()
    verdict, detail, fix = found["huge.jsonl"]
    assert verdict == "warn"
    assert detail == (
        f"{data}: 1 line over the 1048576-byte row limit (the longest 200.00 MB): prepare skips them as too_long"
    )
    assert fix.startswith("split or drop those rows, or raise data.max_length")


def test_a_file_of_nothing_but_an_over_long_row_fails(tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "x" * 2**21}]}) + "\n")
    verdict, detail, _ = run(data)["one.jsonl"]
    assert verdict == "fail" and "no other row: prepare would skip every row as too_long" in detail


def test_empty_binary_and_latin1_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    assert run(empty)["empty.jsonl"][:2] == ("fail", f"{empty}: the file is empty")

    binary = tmp_path / "data.jsonl"
    binary.write_bytes(b"\x1f\x8b\x08\x00" + bytes(range(256)) * 64)  # a gzip stream, say
    verdict, detail, fix = run(binary)["data.jsonl"]
    assert (verdict, detail) == ("fail", f"{binary}: NUL bytes in its first MBs: a binary file, not JSON/JSONL text")
    assert fix.startswith("point data.path at the JSONL/JSON text")

    latin1 = tmp_path / "latin1.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Où est le café n° {i} ?"},
                {"role": "assistant", "content": "À gauche."},
            ]
        }
        for i in range(3)
    ]
    latin1.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("latin-1"))
    found = doctor_data.check(DataConfig(path=str(latin1), format="auto", max_length=256))
    encoding = [c for c in found if "is not UTF-8" in c.detail]
    assert len(encoding) == 1 and encoding[0].verdict == "warn"
    assert "byte 0xf9 at offset 44 is not UTF-8 (Latin-1 or another legacy encoding?)" in encoding[0].detail
    assert encoding[0].fix.startswith("convert it to UTF-8, e.g. iconv -f latin1 -t utf-8")
    # Every row has an accent, so prepare would keep none of them: that fails too.
    rows_check = [c for c in found if "rows parses" in c.detail]
    assert len(rows_check) == 1 and rows_check[0].verdict == "fail"
    assert 'none of its first 3 rows parses as data.format "auto" (not_utf8 3)' in rows_check[0].detail


def test_rows_of_another_format_and_a_directory(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps({"text": "plain"}) + "\n")
    (folder / "b.jsonl").write_text("")
    found = run(folder, fmt="auto")
    assert found["a.jsonl"][0] == "warn" and "1 of its first 2 rows do not parse" in found["a.jsonl"][1]
    assert "missing_field 1" in found["a.jsonl"][1]
    assert found["b.jsonl"][:2] == ("warn", f"{folder / 'b.jsonl'}: the file is empty")  # another file has rows
    # OpenAI rows read as ShareGPT: none parses, the file would give prepare nothing.
    only = tmp_path / "openai.jsonl"
    only.write_text(json.dumps(CHAT) + "\n")
    verdict, detail, fix = run(only, fmt="sharegpt")["openai.jsonl"]
    assert verdict == "fail" and "(missing_field 1)" in detail and "data.format" in fix


def test_a_json_array_too_big_to_parse_fails_pointing_to_jsonl(tmp_path):
    big = tmp_path / "big.json"
    row = json.dumps(CHAT).encode()
    with open(big, "wb") as f:
        f.write(b"[")
        f.write((row + b",\n") * (ARRAY_MAX_BYTES // len(row) + 1))
        f.write(row + b"]")
    try:
        verdict, detail, fix = run(big)["big.json"]
    finally:
        big.unlink()
    assert verdict == "fail" and "is too big to parse in memory" in detail
    assert fix.startswith("write one JSON object per line (JSONL)") and "jq -c '.[]'" in fix
    missing = run(tmp_path / "nope.jsonl")["path"]
    assert missing[0] == "fail" and "does not exist" in missing[1]
