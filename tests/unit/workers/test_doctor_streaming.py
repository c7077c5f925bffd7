"""`eyas doctor`'s check of a streaming run's shared GPUs (workers/doctor/streaming.py): the
draft's parameters counted as on real drafts, and for the Kimi-K2.5-shaped target of the doctor's
tests (tests/support/doctor_models.py) the arithmetic of vLLM's share plus a training rank on
one card, with the placement the scheduler makes and the fixes the same arithmetic finds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from doctor_models import MODELS

from eyas.state.drafttables import DraftConfig, ExtractConfig, StorageConfig
from eyas.state.executiontables import ResourcesConfig, StageConfig
from eyas.state.inputtables import DataConfig
from eyas.state.runconfig import RunConfig
from eyas.workers.doctor import memory as doctor_memory
from eyas.workers.doctor import memoryestimate, streaming

GB = 10**9
KIMI, KIMI_BYTES, _ = MODELS["kimi"]
# Kimi-K2.5's draft (DeepSeek-V3's text shape: hidden 7168, 128 heads of head_dim 64, i.e.
# qk_rope_head_dim, dense FFN 18432; draft vocabulary 32000 of 163840, 3 aux layers).
KIMI_TRAINABLE = (
    2 * 7168 * (128 + 2 * 128) * 64  # q, k, v of the first layer, reading 2 × hidden
    + 128 * 64 * 7168  # o
    + 3 * 7168 * 18432  # gate, up, down
    + 3 * 7168  # its three norms
    + 3 * 7168 * 7168  # fc over the 3 aux layers
    + 3 * 7168  # the norm before it
    + 7168  # the output norm
)
KIMI_FROZEN = 163840 * 7168 + 2 * 7168 * 32000 + 7168  # embedding, draft and verifier heads, norm
# Per token of the 8192-token step: 3 TTT steps of one layer's bf16 tensors (4 hidden copies, the
# 2 × hidden input, q/k/v, 3 MLP widths) and 10 bytes a draft logit; once, the bf16 inputs (3
# aux + the last state) and 8 bytes a target logit.
KIMI_ACTIVATIONS = 8192 * (
    3 * (2 * (4 * 7168 + 2 * 7168 + 384 * 64 + 3 * 18432) + 10 * 32000) + 2 * 4 * 7168 + 8 * 32000
)
KIMI_TRAIN = 4 * (KIMI_TRAINABLE + KIMI_FROZEN) + 4 * KIMI_TRAINABLE + 8 * KIMI_TRAINABLE + KIMI_ACTIVATIONS + 2**30
H200 = 141 * GB  # as docs/streaming.md's arithmetic counts an H200
TRAIN_TEXT = (
    "draft 0.96 B trainable + 1.63 B frozen parameters: weights 10.38 GB (fp32) + grads 3.85 GB + "
    "AdamW 7.69 GB + activations 16.47 GB (8192 tokens a step) + CUDA context 1.07 GB = 39.46 GB"
)


def test_the_figures_behind_the_text():
    assert (KIMI_TRAINABLE, KIMI_FROZEN) == (961_594_368, 1_633_164_288)
    assert (KIMI_ACTIVATIONS, KIMI_TRAIN) == (16_471_031_808, 39_462_940_672)


def _kimi(tmp_path: Path, util: float | None = 0.6, train_ranks: int | None = None, **storage) -> RunConfig:
    (tmp_path / "chat.jsonl").write_text("")
    options = {"vllm": {"gpu_memory_utilization": util}} if util is not None else {}
    stages = {"extract": StageConfig(options=options)}
    if train_ranks is not None:
        stages["train"] = StageConfig(ranks=train_ranks)
    return RunConfig(
        name="kimi",
        data=DataConfig(path=str(tmp_path / "chat.jsonl")),
        extract=ExtractConfig(backend="vllm", tensor_parallel_size=8, layer_ids=(2, 30, 58, 61)),
        resources=ResourcesConfig(ranks=1),
        draft=DraftConfig(vocab_size=32000),
        storage=StorageConfig(mode="streaming", **storage),
        stages=stages,
    )


def _gpus(total: int, n: int, name: str = "NVIDIA H200") -> list[dict]:
    return [{"index": i, "name": name, "mem_total": total, "mem_used": 0} for i in range(n)]


def test_kimi_streaming_on_eight_h200s_shares_them_at_utilization_06(tmp_path):
    c = streaming.check(_kimi(tmp_path), KIMI_BYTES, _gpus(H200, 8), KIMI, 4)
    assert (c.verdict, c.data["placement"], c.data["trainable"], c.data["frozen"]) == (
        "pass",
        "shared",
        KIMI_TRAINABLE,
        KIMI_FROZEN,
    )
    assert (c.data["extract_share"], c.data["train_need"], c.data["need"]) == (
        84_600_000_000,
        KIMI_TRAIN,
        84_600_000_000 + KIMI_TRAIN,
    )
    assert c.detail == (
        "train shares extract's GPUs (8 for extract, 8 usable, 1 train rank(s)): vLLM's 0.60 × 141.00 GB = "
        f"84.60 GB ([stages.extract] options.vllm) + a training rank needs {TRAIN_TEXT} = 124.06 GB; "
        "GPU 0 has 141.00 GB free"
    )
    assert c.label == "resources: streaming"


def test_kimi_streaming_at_092_is_told_the_utilization_that_leaves_room_for_training(tmp_path):
    c = streaming.check(_kimi(tmp_path, util=0.92), KIMI_BYTES, _gpus(H200, 8), KIMI, 4)
    assert (c.verdict, c.data["need"]) == ("fail", 129_720_000_000 + KIMI_TRAIN)
    assert c.detail.endswith(f"+ a training rank needs {TRAIN_TEXT} = 169.18 GB, over GPU 0's 141.00 GB free")
    # (141 - 39.46) / 141 = 0.720 of the card is left to vLLM, which holds the target's 80.29 GB
    # (the memory check's arithmetic); no power-of-two step gets the rank into the 11.28 GB left.
    assert (
        memoryestimate.estimate(
            memoryestimate.engine_of(_kimi(tmp_path)), memoryestimate.shape_of(KIMI), KIMI_BYTES, _gpus(H200, 1)[0]
        ).total
        <= 0.72 * H200
    )
    assert c.fix == (
        "set [stages.extract] options = { vllm = { gpu_memory_utilization = 0.72 } }; "
        "or run where 9 GPUs are usable, so that train's 1 rank(s) take GPUs of their own"
    )


def test_kimi_streaming_on_80gb_gpus_must_take_separate_ones(tmp_path):
    c = streaming.check(_kimi(tmp_path, util=0.92), KIMI_BYTES, _gpus(80 * GB, 8, "NVIDIA H100 80GB HBM3"), KIMI, 4)
    # 73.60 GB of vLLM + 39.46 GB; lowering vLLM to (80 - 39.46) / 80 = 0.50 leaves 40 GB, under
    # the target's 80.29 GB: only GPUs of its own fit training.
    assert (c.verdict, c.data["need"]) == ("fail", 73_600_000_000 + KIMI_TRAIN)
    assert c.fix == "run where 9 GPUs are usable, so that train's 1 rank(s) take GPUs of their own"
    apart = streaming.check(_kimi(tmp_path, util=0.92), KIMI_BYTES, _gpus(80 * GB, 9), KIMI, 4)
    assert (apart.verdict, apart.data["placement"], apart.data["train_need"]) == ("pass", "separate", KIMI_TRAIN)
    assert apart.detail == (
        f"train's 1 rank(s) get GPUs of their own (8 for extract, 9 usable); a training rank needs {TRAIN_TEXT}, "
        "GPU 0 has 80.00 GB free"
    )


def test_a_step_too_large_for_the_room_left_is_told_the_step_that_fits(tmp_path):
    cfg = _kimi(tmp_path, util=0.6)
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"batch_tokens": 65536})})
    c = streaming.check(cfg, KIMI_BYTES, _gpus(H200, 8), KIMI, 4)
    state = KIMI_TRAIN - KIMI_ACTIVATIONS  # weights, grads, AdamW, context: 22.99 GB
    assert (c.verdict, c.data["need"]) == ("fail", 84_600_000_000 + state + 8 * KIMI_ACTIVATIONS)
    # 56.40 GB are left beside vLLM's 84.60: 16384 tokens a step (22.99 + 32.94 = 55.93 GB) fit,
    # 32768 do not; and no utilization leaves vLLM the target's 80.29 GB beside 154.76 GB.
    assert state + 2 * KIMI_ACTIVATIONS <= 141 * GB - 84_600_000_000 < state + 4 * KIMI_ACTIVATIONS
    assert c.fix == (
        "lower train.batch_tokens to 16384; or run where 9 GPUs are usable, so that train's 1 rank(s) take GPUs "
        "of their own"
    )


def test_more_train_ranks_than_extract_gpus_would_wait_for_ever(tmp_path):
    c = streaming.check(_kimi(tmp_path, train_ranks=9), KIMI_BYTES, _gpus(H200, 8), KIMI, 4)
    assert (c.verdict, c.data["placement"]) == ("fail", "none")
    assert c.fix == "set [stages.train] ranks = 8 or fewer"
    # Two train ranks: DDP's gradient buckets count too.
    two = streaming.check(_kimi(tmp_path, train_ranks=2), KIMI_BYTES, _gpus(H200, 8), KIMI, 4)
    assert two.data["train_need"] == KIMI_TRAIN + 4 * KIMI_TRAINABLE and "grads and DDP buckets 7.69 GB" in two.detail


def test_offline_or_cpu_has_no_such_check(tmp_path):
    offline = _kimi(tmp_path).model_copy(update={"storage": StorageConfig()})
    assert streaming.check(offline, KIMI_BYTES, _gpus(H200, 8), KIMI, 4) is None
    assert streaming.check(_kimi(tmp_path), KIMI_BYTES, [], KIMI, 4) is None


def test_the_hf_extractors_share_is_the_memory_checks_need(tmp_path):
    llama, llama_bytes, _ = MODELS["llama"]
    (tmp_path / "chat.jsonl").write_text("")
    cfg = RunConfig(
        name="l",
        data=DataConfig(path=str(tmp_path / "chat.jsonl")),
        draft=DraftConfig(vocab_size=32000),
        storage=StorageConfig(mode="streaming"),
    )
    gpus = _gpus(80 * GB, 1, "NVIDIA H100 80GB HBM3")
    c = streaming.check(cfg, llama_bytes, gpus, llama, 4)
    mem = doctor_memory.memory(cfg, llama_bytes, gpus, model=llama)
    assert (c.verdict, c.data["placement"], c.data["extract_share"]) == ("pass", "shared", mem.data["need"])
    assert c.data["extract_share"] == 19_080_421_376  # tests/integration/workers/test_doctor.py's figure
    assert c.detail.startswith("train shares extract's GPUs (1 for extract, 1 usable, 1 train rank(s)): the hf ")


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("layers", [1, 2])
def test_the_parameter_count_is_the_real_drafts(tmp_path_factory, family, layers):
    """Built by the train stage's own builder on the tiny targets (DeepSeek-V3: MLA, whose
    head_dim transformers sets to qk_rope_head_dim), with a draft vocabulary of half the target's."""
    from eyas.workers.models import assets
    from eyas.workers.train import model as draft_model

    root = tmp_path_factory.mktemp(family)
    target = assets.build_model(root / family, family)
    config = json.loads((target / "config.json").read_text())
    vocab, draft_vocab = config["vocab_size"], config["vocab_size"] // 2
    t2d = np.zeros(vocab, bool)
    t2d[:draft_vocab] = True
    np.save(root / f"d2t-{draft_vocab}.npy", np.zeros(draft_vocab, np.int64))
    np.save(root / f"t2d-{draft_vocab}.npy", t2d)
    model = draft_model.build(str(target), [1, 2, 3], draft_vocab, layers, 3, root, "sdpa")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    cfg = RunConfig(name="x", draft=DraftConfig(vocab_size=draft_vocab, num_layers=layers))
    assert streaming.draft_parameters(streaming.draft_shape(config, cfg, 4)) == (trainable, frozen)
