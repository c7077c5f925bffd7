"""The bytes of one hidden-states file: `write()` stores a sample as [storage] hidden_dtype says, and `read()` gives any file eyas can read back as plain tensors, refusing every other.

Two formats, both named hs_<idx>.safetensors and both holding `hidden_states` and `token_ids`:

- "target" (the default): speculators' offline format, `hidden_states` [seq, n_ids, hidden] in
  the target's dtype and `token_ids` [seq] int64, with no metadata. The bytes are those eyas
  wrote before fp8 existed; speculators' file backend reads them.
- "fp8": `hidden_states` float8_e4m3fn [seq, n_ids, hidden], `hidden_states_scales`
  float8_e8m0fnu [seq, n_ids, 1] and `token_ids` [seq] int64; the header's metadata says so
  ({"eyas_hidden_dtype": "fp8_e4m3", "eyas_scale": "pow2_per_token_layer"}). The value is
  hidden_states × hidden_states_scales, broadcast over the hidden dimension.

The fp8 scale of a row (one token at one layer id) is the least power of two s with
448·s >= amax(|row|) (448: e4m3's largest value), stored as E8M0 (one byte: OCP
microscaling's scale format). A power of two, because it makes the scaling exact (x / s
rounds nothing), so e4m3's own rounding is the only error, and costs one byte instead of
two or four; the names and the broadcastable shape are hs_connectors' FP8 layout, so
speculators' fp8 hidden-states backend (FP8Transfer) reads eyas's fp8 files too.

The error bound (tests/unit/workers/test_hsformat.py measures it): e4m3 keeps 3 mantissa
bits, so an element with |x| >= 2^-6·s (a normal e4m3 value after scaling) comes back
within 2^-4·|x|; a smaller one (a subnormal) within 2^-10·s. As s < amax/224, every element
of a row is within 2^-4·amax of its value, and only elements below amax/14336 fall to the
coarser subnormal grid. fp8 has no infinity: a row holding inf or NaN is refused on write.

torch is imported in the functions: extract/hswriter.py imports this module at its top.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eyas.state.drafttables import HIDDEN_DTYPES

# The header's metadata of an fp8 file; a plain file has none.
MARK_KEY = "eyas_hidden_dtype"
SCALE_KEY = "eyas_scale"
FP8_MARK = "fp8_e4m3"
FP8_SCALE = "pow2_per_token_layer"
FP8_METADATA = {MARK_KEY: FP8_MARK, SCALE_KEY: FP8_SCALE}
SCALES = "hidden_states_scales"  # hs_connectors' name (fp8_utils.SCALES_KEY)
E4M3_MAX = 448.0
E8M0_MIN_EXP = -127  # E8M0 holds 2^-127 .. 2^127

__all__ = ["HIDDEN_DTYPES", "FormatError", "Sample", "dequantize", "quantize", "read", "tensors", "write"]


class FormatError(ValueError):
    """A hidden-states file eyas cannot read (or a state fp8 cannot store)."""


@dataclass(frozen=True)
class Sample:
    hidden_states: Any  # [seq, n_ids, hidden]: as stored ("target"), or dequantised to float32 ("fp8")
    token_ids: Any  # [seq] int64 (another integer dtype is widened)
    hidden_dtype: str  # the file's format: "target" or "fp8"


def quantize(hidden) -> tuple[Any, Any]:
    """(float8_e4m3fn [..., hidden], float8_e8m0fnu [..., 1]): a power-of-two scale per row."""
    import torch

    # Dividing by a power of two only moves the exponent, so bf16 states are scaled in bf16 (half
    # the memory traffic of float32) to the same bits; float16's narrow range could underflow.
    x = hidden if hidden.dtype in (torch.float32, torch.bfloat16) else hidden.float()
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    if not bool(torch.isfinite(amax).all()):
        raise FormatError(
            "the hidden states hold inf or NaN, which fp8 cannot store; the target computes non-finite "
            'states (check its dtype), or set [storage] hidden_dtype = "target" to keep them as they are'
        )
    # amax/448 = m·2^e with m in [0.5, 1): the least k with 2^k >= amax/448 is e, or e-1 when m
    # is exactly 0.5. An all-zero row gets 2^0.
    m, e = torch.frexp(amax / E4M3_MAX)
    k = torch.where(amax > 0, e - (m == 0.5).to(e.dtype), torch.zeros_like(e)).clamp_(E8M0_MIN_EXP, 127)
    scale = torch.ldexp(torch.ones_like(amax), k)
    # The clamp only catches amax/448 rounded below its true value in float32 (one ulp).
    q = (x / scale.to(x.dtype)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.to(torch.float8_e8m0fnu)


def dequantize(q, scales, dtype=None):
    """q × scales: exact in float32, and in bfloat16 too unless a row's amax is below 1e-34 (an
    e4m3 value has 3 mantissa bits, and the scale only moves its exponent)."""
    import torch

    dtype = dtype or torch.float32
    return q.to(dtype).mul_(scales.to(dtype))


def tensors(hidden, token_ids, hidden_dtype: str) -> tuple[dict[str, Any], dict[str, str] | None]:
    """(the file's tensors, its metadata) for one sample stored as `hidden_dtype`."""
    if hidden_dtype == "target":
        return {"hidden_states": hidden, "token_ids": token_ids}, None
    if hidden_dtype == "fp8":
        q, scales = quantize(hidden)
        return {"hidden_states": q, SCALES: scales, "token_ids": token_ids}, dict(FP8_METADATA)
    raise ValueError(f"storage.hidden_dtype: unknown value {hidden_dtype!r}; use one of: {', '.join(HIDDEN_DTYPES)}")


def write(path: Path, hidden, token_ids, hidden_dtype: str = "target") -> int:
    """Write one sample to `path` (the caller makes it atomic); returns the tensors' bytes."""
    from safetensors.torch import save_file

    out, metadata = tensors(hidden, token_ids, hidden_dtype)
    # metadata=None for "target": byte for byte the call eyas always made.
    save_file(out, path, metadata=metadata)
    return sum(t.numel() * t.element_size() for t in out.values())


def read(path: Path, dtype=None) -> Sample:
    """One file as plain tensors: fp8 dequantised (to `dtype`, float32 by default). Raises
    FormatError, naming what the file holds, for anything eyas did not write."""
    import torch
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        names = set(f.keys())
        mark = meta.get(MARK_KEY)
        if mark is None:
            _expect(path, names, {"hidden_states", "token_ids"}, "speculators' format (no eyas metadata)")
            hidden = f.get_tensor("hidden_states")
            if not hidden.is_floating_point() or hidden.element_size() < 2:
                raise FormatError(
                    f"{path}: hidden_states is {hidden.dtype} without eyas's metadata saying how to scale it "
                    f"(an fp8 file of another tool?); eyas reads its own fp8 files ({MARK_KEY} = {FP8_MARK!r}) "
                    "and speculators' plain ones: extract again into a fresh output_dir"
                )
            return Sample(hidden, _ids(path, f.get_tensor("token_ids")), "target")
        if mark != FP8_MARK or meta.get(SCALE_KEY) != FP8_SCALE:
            raise FormatError(
                f"{path}: stored as {MARK_KEY} = {mark!r}, {SCALE_KEY} = {meta.get(SCALE_KEY)!r}, a format this "
                f"eyas cannot read (it reads {FP8_MARK!r} with {FP8_SCALE!r}, and speculators' plain files); "
                "train with the eyas that extracted it, or extract again into a fresh output_dir"
            )
        _expect(path, names, {"hidden_states", SCALES, "token_ids"}, f"an fp8 file ({FP8_MARK})")
        q, scales = f.get_tensor("hidden_states"), f.get_tensor(SCALES)
        if q.dtype != torch.float8_e4m3fn or scales.dtype != torch.float8_e8m0fnu:
            raise FormatError(
                f"{path}: an fp8 file whose hidden_states is {q.dtype} and {SCALES} {scales.dtype}; "
                "expected float8_e4m3fn and float8_e8m0fnu: the file is damaged, extract again"
            )
        if q.ndim != 3 or tuple(scales.shape) != (*q.shape[:2], 1):
            raise FormatError(
                f"{path}: {SCALES} has shape {tuple(scales.shape)} for hidden_states of shape {tuple(q.shape)}; "
                "expected [seq, n_ids, 1]: the file is damaged, extract again"
            )
        return Sample(dequantize(q, scales, dtype), _ids(path, f.get_tensor("token_ids")), "fp8")


def _expect(path: Path, names: set[str], wanted: set[str], what: str) -> None:
    if names != wanted:
        raise FormatError(
            f"{path}: holds tensors {sorted(names)}, but {what} holds {sorted(wanted)}; "
            "extract again into a fresh output_dir"
        )


def _ids(path: Path, ids):
    import torch

    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.ndim != 1:
        raise FormatError(f"{path}: token_ids is {ids.dtype} of shape {tuple(ids.shape)}; expected int64 [seq]")
    return ids.to(torch.int64)
