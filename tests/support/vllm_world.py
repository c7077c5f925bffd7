"""What the vLLM tests share: tiny targets with the seed's config quirks, the test-only worker extensions and model classes (imported by vLLM's processes from PYTHONPATH), and prepared datasets of given token rows."""

from __future__ import annotations

import json
import os
import random
import textwrap
from pathlib import Path

from daemon_harness import private_daemon
from safetensors.torch import load_file, save_file

from eyas.workers.models import assets

# vLLM's CPU build takes 4 GiB of KV cache per engine unless told otherwise.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def build_models(root: Path) -> dict[str, Path]:
    """The tiny llama, the tiny DeepseekV3 (scoring_func as real DeepSeek-V3 configs say) and the Kimi-nested one."""
    out = {f: assets.build_model(root / f, f) for f in ("llama", "deepseek_v3")}
    # transformers' DeepseekV3 routes with sigmoid and writes no scoring_func; vLLM then
    # falls back to softmax (DeepSeek-V2's). Real DeepSeek-V3 configs say "sigmoid".
    cfg_path = out["deepseek_v3"] / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["scoring_func"] = "sigmoid"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    out["kimi"] = build_kimi_wrapper(root / "kimi", out["deepseek_v3"])
    return out


def write_extensions(path: Path) -> Path:
    """EXTENSIONS as modules in `path` (put it on the ranks' PYTHONPATH)."""
    for name, source in EXTENSIONS.items():
        (path / name).write_text(textwrap.dedent(source))
    return path


def build_kimi_wrapper(path: Path, deepseek: Path) -> Path:
    """The tiny DeepseekV3 one level deeper, as Kimi-K2.5 nests it: language_model.model."""
    path.mkdir()
    cfg = json.loads((deepseek / "config.json").read_text())
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = {f"language_model.{k}": v.contiguous() for k, v in load_file(deepseek / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


# Test-only worker extensions and model classes, imported by vLLM's processes from PYTHONPATH.
EXTENSIONS = {
    "seed_ext.py": '''
        """speculators 0.3.0's custom worker, as far as the seed goes: it replaces the base model's
        forward with a generic, Llama-shaped one (get_input_embeddings, keyword layer calls)."""
        import types

        from eyas.workers.vllm.ext import EyasWorkerExtension


        class Speculators030Worker(EyasWorkerExtension):
            def eyas_setup(self, spec):
                reply = super().eyas_setup(spec)
                print(f"seed extension: TP rank {self.rank} patches the base model's forward", flush=True)
                base = self.get_model().model

                def patched_forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                                    **kwargs):
                    hidden_states = inputs_embeds if inputs_embeds is not None else self.get_input_embeddings(input_ids)
                    residual = None
                    for layer in self.layers:
                        hidden_states, residual = layer(hidden_states=hidden_states, positions=positions,
                                                        residual=residual)
                    hidden_states, _ = self.norm(hidden_states, residual)
                    return hidden_states

                base.forward = types.MethodType(patched_forward, base)
                return reply
    ''',
    "kimi_wrapper.py": '''
        """A tiny Kimi-K2.5-shaped vLLM model: the DeepseekV3 causal LM under language_model."""
        from torch import nn
        from vllm import ModelRegistry
        from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
        from vllm.model_executor.models.utils import maybe_prefix


        class TinyKimiK25(nn.Module):
            def __init__(self, *, vllm_config, prefix=""):
                super().__init__()
                self.language_model = DeepseekV3ForCausalLM(vllm_config=vllm_config,
                                                            prefix=maybe_prefix(prefix, "language_model"))
                self.make_empty_intermediate_tensors = self.language_model.make_empty_intermediate_tensors

            def embed_input_ids(self, input_ids):
                return self.language_model.embed_input_ids(input_ids)

            def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
                return self.language_model(input_ids, positions, intermediate_tensors, inputs_embeds)

            def compute_logits(self, hidden_states):
                return self.language_model.compute_logits(hidden_states)

            def load_weights(self, weights):
                inner = ((name.removeprefix("language_model."), w) for name, w in weights)
                return {"language_model." + name for name in self.language_model.load_weights(inner)}


        ModelRegistry.register_model("KimiK25ForConditionalGeneration", "kimi_wrapper:TinyKimiK25")
    ''',
    "slow_ext.py": '''
        """eyas's extension, with a pause before each batch, so that a test can act mid-extraction."""
        import time

        from eyas.workers.vllm.ext import EyasWorkerExtension


        class SlowExtension(EyasWorkerExtension):
            def eyas_expect(self, requests):
                time.sleep(0.25)
                return super().eyas_expect(requests)
    ''',
    "wrapper_ext.py": '''
        """eyas's extension, plus the tiny Kimi wrapper registered in every process that imports it."""
        import kimi_wrapper  # noqa: F401

        from eyas.workers.vllm.ext import EyasWorkerExtension


        class WrapperExtension(EyasWorkerExtension):
            pass
    ''',
}


def token_rows(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def write_dataset(output_dir: Path, rows: list[list[int]]) -> None:
    import datasets

    ds = datasets.Dataset.from_dict(
        {"input_ids": rows, "loss_mask": [[1] * len(r) for r in rows], "seq_len": [len(r) for r in rows]}
    )
    ds.save_to_disk(str(output_dir / "prepare" / "dataset"))


def vllm_daemon(ext_dir: Path):
    """A real daemon (daemon_harness.private_daemon) whose ranks find the test extensions in
    `ext_dir` and keep vLLM's CPU cache small."""
    env = {**VLLM_ENV, "PYTHONPATH": os.pathsep.join([str(ext_dir), os.environ.get("PYTHONPATH", "")])}
    return private_daemon(grace=5.0, extra_env=env)
