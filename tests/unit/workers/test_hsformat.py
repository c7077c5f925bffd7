"""workers/extract/hsformat.py: the fp8 round trip against its documented error bound, the file
sizes against bf16 files of the same states, the default format byte for byte, the reader's
refusals, and the background writer storing fp8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eyas.workers.extract import hsformat, hswriter

BOUND = 2.0**-4  # e4m3's 3 mantissa bits: half an ulp is 2^-4 of a binade's bottom


def states(seq: int, n_ids: int, hidden: int, seed: int = 0) -> torch.Tensor:
    """Residual-stream-like states: each layer id its own magnitude (decades apart, as early and
    late layers are), a few outliers per token, and one token of all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(seq, n_ids, hidden, generator=g)
    x *= torch.logspace(-2, 2, n_ids).view(1, n_ids, 1)
    outliers = torch.randint(0, hidden, (seq, n_ids, 2), generator=g)
    x.scatter_(-1, outliers, x.gather(-1, outliers) * 30)
    x[seq // 2] = 0
    return x


def test_the_round_trip_is_within_the_documented_bound_and_reaches_it():
    x = states(512, 4, 256)
    q, scales = hsformat.quantize(x)
    assert (q.dtype, q.shape, scales.dtype, scales.shape) == (
        torch.float8_e4m3fn,
        x.shape,
        torch.float8_e8m0fnu,
        (512, 4, 1),
    )
    got = hsformat.dequantize(q, scales)
    err = (got - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    s = scales.float()

    # The scale: the least power of two with 448·s >= amax (an all-zero row: 1).
    assert torch.equal(torch.log2(s), torch.log2(s).round())
    live = amax > 0
    assert bool(((amax <= 448 * s) & (amax > 224 * s))[live].all())
    assert bool((s[~live] == 1).all()) and bool((got[x.abs().amax(-1) == 0] == 0).all())

    # Every element within 2^-4 of its row's amax; a normal one within 2^-4 of itself, a
    # subnormal one (below 2^-6 of the scale) within 2^-10 of the scale.
    assert bool((err <= BOUND * amax).all())
    normal = x.abs() >= s * 2.0**-6
    rel = err[normal] / x.abs()[normal]
    assert bool((rel <= BOUND).all())
    assert bool((err[~normal] <= s.expand_as(x)[~normal] * 2.0**-10).all())
    # Measured: round to nearest reaches the bound's worst case, 2^-4 / (1 + 2^-4), on these values.
    worst_row, worst_rel = float((err / amax.clamp_min(1e-30)).max()), float(rel.max())
    print(f"max |error| / row amax = {worst_row:.5f}, max relative error (normal) = {worst_rel:.5f}")
    assert worst_rel == pytest.approx(BOUND / (1 + BOUND), rel=0.01)
    assert 0.9 * BOUND < worst_row <= BOUND
    # Small values lose more: the mean relative error of the row's smallest decile is larger
    # than that of its largest (the subnormal floor), yet the bound above holds for both.
    small = x.abs() < 0.01 * amax
    assert float((err[small & live.expand_as(x)] / x.abs()[small & live.expand_as(x)].clamp_min(1e-30)).mean()) > float(
        rel.mean()
    )


def test_bf16_states_quantise_the_same_as_their_float32_values():
    x = states(64, 4, 128).to(torch.bfloat16)
    q16, s16 = hsformat.quantize(x)
    q32, s32 = hsformat.quantize(x.float())
    assert torch.equal(q16.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(
        s16.view(torch.uint8), s32.view(torch.uint8)
    )


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_states_are_refused_not_stored(bad):
    x = states(8, 2, 64)
    x[3, 1, 5] = bad
    with pytest.raises(hsformat.FormatError, match="hold inf or NaN, which fp8 cannot store"):
        hsformat.quantize(x)


@pytest.mark.parametrize("hidden, seq", [(64, 512), (128, 256), (4096, 128)])
def test_fp8_files_take_at_most_052_of_bf16_files_of_the_same_states(tmp_path, hidden, seq):
    x, ids = states(seq, 4, hidden), torch.arange(seq, dtype=torch.int64) * 7
    fp8, bf16 = tmp_path / "fp8.safetensors", tmp_path / "bf16.safetensors"
    payload = hsformat.write(fp8, x, ids, "fp8")
    hsformat.write(bf16, x.to(torch.bfloat16), ids)
    # The payload: one byte per value, one per (token, layer id) scale, eight per token id.
    assert payload == seq * 4 * hidden + seq * 4 + seq * 8
    header = 8 + int.from_bytes(fp8.read_bytes()[:8], "little")
    assert fp8.stat().st_size == header + payload
    ratio = fp8.stat().st_size / bf16.stat().st_size
    print(f"hidden {hidden}, seq {seq}, 4 layer ids: fp8/bf16 = {ratio:.4f}")
    assert ratio <= 0.52


def test_default_files_are_byte_for_byte_what_eyas_always_wrote(tmp_path):
    x, ids = states(33, 3, 64).to(torch.bfloat16), torch.arange(33, dtype=torch.int64)
    hsformat.write(tmp_path / "new.safetensors", x, ids)
    save_file({"hidden_states": x, "token_ids": ids}, tmp_path / "old.safetensors")  # the old writer's call
    assert (tmp_path / "new.safetensors").read_bytes() == (tmp_path / "old.safetensors").read_bytes()
    back = hsformat.read(tmp_path / "new.safetensors")
    assert back.hidden_dtype == "target" and torch.equal(back.hidden_states, x) and torch.equal(back.token_ids, ids)


def test_fp8_files_are_marked_and_read_back_dequantised(tmp_path):
    x, ids = states(40, 4, 64), torch.arange(40, dtype=torch.int64)
    path = tmp_path / "hs_0.safetensors"
    hsformat.write(path, x, ids, "fp8")
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"eyas_hidden_dtype": "fp8_e4m3", "eyas_scale": "pow2_per_token_layer"}
    back = hsformat.read(path)
    assert back.hidden_dtype == "fp8" and back.hidden_states.dtype == torch.float32
    assert torch.equal(back.hidden_states, hsformat.dequantize(*hsformat.quantize(x)))
    assert torch.equal(back.token_ids, ids)


def _rewrite(path: Path, metadata=None, **changes) -> None:
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    for k, v in changes.items():
        if v is None:
            tensors.pop(k)
        else:
            tensors[k] = v
    save_file(tensors, path, metadata=meta if metadata is None else metadata)


@pytest.mark.parametrize(
    "start, metadata, changes, message",
    [
        (
            "fp8",
            {"eyas_hidden_dtype": "fp4_e2m1", "eyas_scale": "pow2_per_token_layer"},
            {},
            r"stored as eyas_hidden_dtype = 'fp4_e2m1', eyas_scale = 'pow2_per_token_layer', a format this eyas "
            r"cannot read \(it reads 'fp8_e4m3' with 'pow2_per_token_layer', and speculators' plain files\)",
        ),
        (
            "fp8",
            {"eyas_hidden_dtype": "fp8_e4m3", "eyas_scale": "per_tensor"},
            {},
            r"eyas_scale = 'per_tensor', a format this eyas cannot read",
        ),
        (
            "fp8",
            {"other": "tool"},
            {},
            r"holds tensors \['hidden_states', 'hidden_states_scales', 'token_ids'\], but speculators' format",
        ),
        (
            "fp8",
            {"other": "tool"},
            {"hidden_states_scales": None},
            r"hidden_states is torch.float8_e4m3fn without eyas's metadata saying how to scale it",
        ),
        (
            "fp8",
            None,
            {"hidden_states_scales": None},
            r"holds tensors \['hidden_states', 'token_ids'\], but an fp8 file",
        ),
        (
            "fp8",
            None,
            {"hidden_states_scales": torch.ones(10, 4, 1)},
            r"hidden_states_scales torch.float32; expected float8_e4m3fn and float8_e8m0fnu",
        ),
        (
            "fp8",
            None,
            {"hidden_states_scales": torch.ones(10, 1, 1).to(torch.float8_e8m0fnu)},
            r"hidden_states_scales has shape \(10, 1, 1\) for hidden_states of shape \(10, 4, 64\)",
        ),
        (
            "target",
            None,
            {"token_ids": torch.zeros(10)},
            r"token_ids is torch.float32 of shape \(10,\); expected int64",
        ),
    ],
)
def test_the_reader_refuses_what_eyas_did_not_write_naming_it(tmp_path, start, metadata, changes, message):
    path = tmp_path / "hs_3.safetensors"
    hsformat.write(path, states(10, 4, 64), torch.arange(10, dtype=torch.int64), start)
    _rewrite(path, metadata, **changes)
    with pytest.raises(hsformat.FormatError, match=message):
        hsformat.read(path)


def test_speculators_fp8_backend_reads_eyas_fp8_files(tmp_path):
    from hs_connectors.transfer import FP8Transfer

    x, ids = states(50, 4, 64), torch.arange(50, dtype=torch.int64)
    hsformat.write(tmp_path / "hs_5.safetensors", x, ids, "fp8")
    theirs = FP8Transfer(tmp_path, dequantize_dtype=torch.float32).get_cached(5)
    assert torch.equal(theirs["hidden_states"], hsformat.read(tmp_path / "hs_5.safetensors").hidden_states)
    assert torch.equal(theirs["token_ids"], ids)


def test_the_writer_stores_fp8_and_counts_the_bytes_it_wrote(tmp_path):
    hidden = states(2 * 30, 3, 64).view(2, 30, 3, 64)
    ids = [torch.arange(30, dtype=torch.int64), torch.arange(20, dtype=torch.int64) + 100]
    writer = hswriter.HiddenStatesWriter(tmp_path, hidden_dtype="fp8")
    writer.put(
        hswriter.Job(
            hidden=hidden,
            items=[hswriter.Item(idx=7, row=0, length=30, token_ids=ids[0]), hswriter.Item(8, 1, 20, ids[1])],
        )
    )
    writer.close()
    assert hswriter.existing(tmp_path) == {7, 8} and sorted(p.name for p in tmp_path.iterdir()) == [
        "hs_7.safetensors",
        "hs_8.safetensors",
    ]
    assert writer.bytes == sum(n * 3 * 64 + n * 3 + n * 8 for n in (30, 20))
    back = hsformat.read(tmp_path / "hs_8.safetensors")
    assert back.hidden_dtype == "fp8" and torch.equal(back.token_ids, ids[1])
    assert bool(
        ((back.hidden_states - hidden[1, :20]).abs() <= BOUND * hidden[1, :20].abs().amax(-1, keepdim=True)).all()
    )


def test_the_writer_fails_the_loop_on_states_fp8_cannot_hold(tmp_path):
    hidden = states(10, 2, 64).view(1, 10, 2, 64)
    hidden[0, 4, 1, 0] = float("inf")
    writer = hswriter.HiddenStatesWriter(tmp_path, hidden_dtype="fp8")
    writer.put(hswriter.Job(hidden=hidden, items=[hswriter.Item(0, 0, 10, torch.arange(10))]))
    with pytest.raises(
        RuntimeError, match=r"writing hidden states to .* failed: FormatError\('the hidden states hold inf"
    ):
        writer.close()
    assert hswriter.existing(tmp_path) == set()
