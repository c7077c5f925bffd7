"""The doctor's stand-ins for vLLM's classes (doctor/vllmsource.py), on a planted vLLM source tree:
the registry read from its tables, classes and signatures compiled from the files, names from
outside vLLM as stand-ins, and nothing in the files ever called."""

from __future__ import annotations

import inspect
from pathlib import Path

from eyas.workers.doctor import adapter, vllmsource

REGISTRY = """
_TEXT_GENERATION_MODELS = {
    "ToyForCausalLM": ("toy", "ToyForCausalLM"),
    "OldForCausalLM": ("toy", "Gone"),
}
_MULTIMODAL_MODELS = {
    "OldForCausalLM": ("toy", "ToyForCausalLM"),  # a later table overrides an earlier one
    "Computed": ("toy", "X" + "Y"),
}
_VLLM_MODELS = {**_TEXT_GENERATION_MODELS, **_MULTIMODAL_MODELS}
"""
TOY = """
import torch
from torch import nn

from .layers import Norm
from vllm.model_executor.models.utils import make_layers

CALLED = []


def side_effect():
    CALLED.append(1)
    return 3


class ToyLayer(nn.Module):
    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                scale: int = side_effect()) -> torch.Tensor:
        return hidden_states


class ToyModel(nn.Module):
    def __init__(self, *, config, prefix: str = ""):
        super().__init__()
        self.layers = make_layers(config.n, lambda prefix: ToyLayer(prefix=prefix))
        self.norm = Norm(config.hidden)

    def embed_input_ids(self, input_ids):
        return input_ids


class ToyForCausalLM(nn.Module):
    model_cls = ToyModel

    def __init__(self, *, config, prefix: str = ""):
        super().__init__()
        side_effect()
        self.model = self.model_cls(config=config)
"""


def _tree(root: Path) -> Path:
    models = root / "vllm" / "model_executor" / "models"
    models.mkdir(parents=True)
    (models / "registry.py").write_text(REGISTRY)
    (models / "toy.py").write_text(TOY)
    (models / "layers.py").write_text("from torch import nn\n\n\nclass Norm(nn.Module):\n    pass\n")
    (models / "utils.py").write_text("def make_layers(n, build):\n    raise RuntimeError('ran')\n")
    return root / "vllm"


def test_the_registry_is_read_from_its_literal_tables(tmp_path):
    reader = vllmsource._StaticVllm(_tree(tmp_path))
    assert reader.registry() == {
        "ToyForCausalLM": ("toy", "ToyForCausalLM"),
        "OldForCausalLM": ("toy", "ToyForCausalLM"),
    }


def test_classes_are_compiled_from_the_source_and_nothing_runs(tmp_path):
    reader = vllmsource._StaticVllm(_tree(tmp_path))
    top = reader.resolve(["Missing", "ToyForCausalLM"])
    assert (top.__module__, top.__qualname__) == ("vllm.model_executor.models.toy", "ToyForCausalLM")
    nn = vllmsource.TORCH_MODULES
    assert top.__mro__[1:] == (nn["torch.nn.Module"], object)
    layer = reader.import_from("vllm.model_executor.models.toy", "ToyLayer")
    # Annotations as the real classes show them; the default that would call is None instead.
    assert str(inspect.signature(layer.forward)) == (
        "(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None, "
        "scale: int = None) -> torch.Tensor"
    )
    toy = reader.module("vllm.model_executor.models.toy")
    assert inspect.getsource(top.__init__).splitlines()[0] == '    def __init__(self, *, config, prefix: str = ""):'
    assert not isinstance(toy["CALLED"], list)  # a module-level value is a stand-in, never built


def test_the_adapter_checks_pass_on_the_stand_ins(tmp_path):
    from eyas.workers.models import adapters, classwalk

    reader = vllmsource._StaticVllm(_tree(tmp_path))
    nn = vllmsource.TORCH_MODULES
    walk = classwalk.ClassReader(
        nn["torch.nn.Module"],
        (nn["torch.nn.ModuleList"], nn["torch.nn.ModuleDict"], nn["torch.nn.Sequential"]),
        reader.resolve,
    )
    toy = adapters.Adapter("toy", ("ToyForCausalLM",), ("model",))
    checks = adapter._checks(walk, reader.resolve(["ToyForCausalLM"]), ("model",), toy, "ToyForCausalLM", "vllm")
    assert [(c.name, c.verdict, c.detail) for c in checks] == [
        (
            "architecture",
            "pass",
            "ToyForCausalLM -> adapter 'toy'; vllm class vllm.model_executor.models.toy.ToyForCausalLM",
        ),
        ("decoder", "pass", "ToyForCausalLM.model -> ToyModel: layers of ToyLayer, norm Norm"),
        (
            "embedding",
            "pass",
            "ToyModel has embed_input_ids, no get_input_embeddings: the vllm adapter calls embed_input_ids()",
        ),
        (
            "layer forward",
            "pass",
            "ToyLayer.forward(self, positions, hidden_states, residual, scale): "
            "the vllm tap reads hidden_states + residual",
        ),
    ]
