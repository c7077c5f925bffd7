"""The doctor's adapter fit: does eyas's adapter match the backend's model classes?

The architecture resolves to its adapter (models/adapters.py), then to the backend's class: vLLM's,
through vLLM's model registry; transformers', as models/hf_target.py loads it. No model is built:
models/classwalk.py reads the classes' __init__ to follow the adapter's decoder paths through any
wrapper. Then the expectations adapters.py holds as data are checked on the classes found:
the embedding method (adapters.API via api_problem) and the decoder layer's forward
(adapters.STREAM_PARAMS via layer_problem), the same functions the extract stage runs on
the loaded model. So a wrong expectation fails here in seconds, with a fix, instead of in a
tensor-parallel worker after the weights have loaded.

vLLM's classes are first read from its source files without importing vLLM (the stand-ins at
the end of this module: a second instead of the 5-10 s that importing a model module takes,
most of the doctor's time). When every check passes on them, that is the answer; any other
outcome is found again on the real classes through vLLM's registry, so each failure and its
wording are the real classes'. What the source cannot tell is whether the model module
imports on this machine (a vLLM-CPU host without torchvision cannot import Qwen-VL's): the
canary (`eyas doctor --canary`, and the preflight stage) runs the engine and finds that.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import copy
import functools
import importlib
import importlib.machinery
import inspect
import sys
import types
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from eyas.workers.doctor.check import Check, failed, passed, warned
from eyas.workers.doctor.target import TargetFacts
from eyas.workers.models import adapters, classwalk

GROUP = "adapter"
# resolve_model_cls reads only these of a ModelConfig for an architecture it has registered
# (vLLM 0.32 and 0.33): a full ModelConfig would parse the checkpoint and need a tokenizer.
_REGISTRY_ONLY = SimpleNamespace(model_impl="auto", runner_type="generate", convert_type="none")


def vllm_class(arch: str) -> type | None:
    """vLLM's model class for `arch` through its registry (imports the model's module only)."""
    from vllm import ModelRegistry

    if arch not in ModelRegistry.get_supported_archs():
        return None
    cls, _ = ModelRegistry.resolve_model_cls([arch], model_config=_REGISTRY_ONLY)
    return cls


def _vllm_reader() -> classwalk.ClassReader:
    from torch import nn

    def resolve(archs: list[str]) -> type | None:
        for arch in archs:
            cls = vllm_class(arch)
            if cls is not None:
                return cls
        return None

    return classwalk.ClassReader(nn.Module, (nn.ModuleList, nn.ModuleDict, nn.Sequential), resolve)


def _hf_reader() -> classwalk.ClassReader:
    from torch import nn

    return classwalk.ClassReader(nn.Module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))


def hf_class(facts: TargetFacts, trust_remote_code: bool) -> tuple[type | None, str]:
    """transformers' class for the target as hf_target.load picks it: built in, else the
    checkpoint's own code through its auto_map (only with trust_remote_code)."""
    import transformers

    arch = facts.architecture
    cls = getattr(transformers, arch, None)
    if isinstance(cls, type):
        return cls, ""
    if not trust_remote_code:
        return None, (
            f"transformers {transformers.__version__} has no {arch}, and the checkpoint's own code "
            "runs only with target.trust_remote_code = true"
        )
    auto = facts.config.get("auto_map") if isinstance(facts.config.get("auto_map"), dict) else {}
    ref = next(
        (auto[k] for k in ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel") if k in auto), None
    )
    if not isinstance(ref, str):
        return None, f"transformers has no {arch} and config.json's auto_map names no model class"
    module_file = Path(facts.path) / (ref.split("--")[-1].rsplit(".", 1)[0] + ".py")
    if not module_file.exists():
        return None, (
            f"transformers has no {arch}, and the custom code it names ({module_file.name}) is not in {facts.path}"
        )
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    try:
        return get_class_from_dynamic_module(ref, facts.path), ""
    except Exception as exc:  # noqa: BLE001 - remote code may raise anything on import
        return None, f"importing {ref} from {facts.path} failed ({type(exc).__name__}: {exc})"


def check(facts: TargetFacts, backend: str, trust_remote_code: bool) -> list[Check]:
    arch = facts.architecture
    try:
        adapter = adapters.adapter_for(arch or "")
    except adapters.UnknownArchitecture:
        return [
            failed(
                GROUP,
                "architecture",
                f"no eyas adapter for {arch}",
                f"add an adapter for {arch} in eyas/workers/models/adapters.py (known: "
                f"{', '.join(adapters.known_architectures())})",
            )
        ]
    if backend == "vllm":
        fast = _static_checks(facts, adapter)
        if fast is not None:
            return fast
        try:
            top = vllm_class(arch)
        except Exception as exc:  # noqa: BLE001 - a model module that fails to import is the finding
            return [
                failed(
                    GROUP,
                    "architecture",
                    f"vLLM's class for {arch} does not import ({type(exc).__name__}: {exc})",
                    'fix the vLLM install (see versions above), or use extract.backend = "hf"',
                )
            ]
        if top is None:
            return [
                failed(
                    GROUP,
                    "architecture",
                    f"vLLM's model registry has no {arch}",
                    'use extract.backend = "hf", or a vLLM release that supports it',
                )
            ]
        reader, paths = _vllm_reader(), adapter.decoder_paths + adapter.vllm_paths
    else:
        top, why = hf_class(facts, trust_remote_code)
        if top is None:
            fix = (
                "set target.trust_remote_code = true"
                if not trust_remote_code
                else "put the checkpoint's modelling code beside config.json"
            ) + ', or use extract.backend = "vllm"'
            return [failed(GROUP, "architecture", why, fix)]
        reader, paths = _hf_reader(), adapter.decoder_paths
    return _checks(reader, top, paths, adapter, arch, backend)


def _checks(
    reader: classwalk.ClassReader, top: type, paths: tuple[str, ...], adapter: adapters.Adapter, arch: str, backend: str
) -> list[Check]:
    """The architecture, decoder, embedding and layer-forward checks on `top`, the backend's class."""
    out = [
        passed(
            GROUP,
            "architecture",
            f"{arch} -> adapter '{adapter.family}'; {backend} class {top.__module__}.{top.__qualname__}",
            family=adapter.family,
            model_class=top.__name__,
        )
    ]
    decoder, layer, check_ = _decoder(reader, top, paths, adapter)
    out.append(check_)
    if decoder is None:
        return out
    out.append(embedding(decoder, backend))
    if layer is not None:
        out.append(layer_forward(layer, backend))
    return out


def _decoder(reader: classwalk.ClassReader, top: type, paths: tuple[str, ...], adapter: adapters.Adapter):
    """(decoder class, layer class, Check): the first path that reaches a class assigning
    both the layers and the norm, as Adapter.decoder takes the first that resolves."""
    reasons, unknown = [], False
    for path in paths:
        found = classwalk.path_class(reader, top, path)
        if not found.ok:
            unknown = unknown or found.state == classwalk.UNKNOWN
            reasons.append(f"{path or '<top>'}: {found.how}")
            continue
        cls = found.cls
        missing = [a for a in (adapter.layers_attr, adapter.norm_attr) if not reader.assigns(cls, a)]
        if missing:
            reasons.append(f"{path}: {cls.__name__} assigns no {' nor '.join(missing)}")
            continue
        layer = reader.element(cls, adapter.layers_attr)
        norm = reader.attr(cls, adapter.norm_attr)
        where = f"{top.__name__}.{path}" if path else top.__name__
        detail = (
            f"{where} -> {cls.__name__}: {adapter.layers_attr} of "
            f"{layer.cls.__name__ if layer.ok else '?'}, {adapter.norm_attr} "
            f"{norm.cls.__name__ if norm.ok else '?'}"
        )
        return (
            cls,
            layer.cls if layer.ok else None,
            passed(
                GROUP,
                "decoder",
                detail,
                path=path,
                decoder_class=cls.__name__,
                layer_class=layer.cls.__name__ if layer.ok else None,
            ),
        )
    tried = ", ".join(p or "<top>" for p in paths)
    if unknown:
        return (
            None,
            None,
            warned(
                GROUP,
                "decoder",
                f"cannot tell from {top.__name__}'s source where its decoder is ({'; '.join(reasons)})",
                "nothing to do unless extract then fails to find "
                f"it; if so, add the path to the '{adapter.family}' adapter in "
                "eyas/workers/models/adapters.py",
                tried=list(paths),
            ),
        )
    return (
        None,
        None,
        failed(
            GROUP,
            "decoder",
            f"{top.__name__} has no decoder at {tried} ({'; '.join(reasons)})",
            f"add the path to {top.__name__}'s decoder (the module holding "
            f"{adapter.layers_attr} and {adapter.norm_attr}) to the '{adapter.family}' adapter's "
            "decoder_paths in eyas/workers/models/adapters.py",
            tried=list(paths),
        ),
    )


def embedding(decoder: type, backend: str) -> Check:
    """The embedding method the backend's adapter calls, e.g. "DeepseekV2Model has
    embed_input_ids, no get_input_embeddings"."""
    expected = adapters.API[backend]["embed"]
    known = set(adapters.KNOWN_METHODS["embed"]) | {api["embed"] for api in adapters.API.values()}
    names = [expected, *sorted(known - {expected})]
    has = [n for n in names if callable(getattr(decoder, n, None))]
    lacks = [n for n in names if n not in has]
    found = f"{decoder.__name__} has {', '.join(has) or 'none of ' + ', '.join(names)}" + (
        f", no {', '.join(lacks)}" if has and lacks else ""
    )
    problem = adapters.api_problem(decoder, "embed", backend)
    data = {"decoder_class": decoder.__name__, "expects": expected, "has": has}
    if problem is None:
        return passed(GROUP, "embedding", f"{found}: the {backend} adapter calls {expected}()", **data)
    if has:
        fix = (
            f"make the {backend} adapter call {has[0]}(): set API['{backend}']['embed'] = '{has[0]}' in "
            "eyas/workers/models/adapters.py"
        )
    else:
        fix = f"add {decoder.__name__}'s embedding method to API['{backend}'] in eyas/workers/models/adapters.py"
    return failed(GROUP, "embedding", f"{found}: the {backend} adapter calls {expected}()", fix, **data)


def layer_forward(layer: type, backend: str) -> Check:
    """The decoder layer's forward against what the backend's tap reads (adapters.STREAM_PARAMS)."""
    params = adapters.STREAM_PARAMS[backend]
    try:
        # Names only: the annotations make a line nobody reads.
        sig = f"({', '.join(inspect.signature(layer.forward).parameters)})"
    except (TypeError, ValueError):
        sig = "(...)"
    problem = adapters.layer_problem(layer, backend)
    data = {"layer_class": layer.__name__, "signature": sig, "needs": list(params)}
    if problem is None:
        return passed(
            GROUP,
            "layer forward",
            f"{layer.__name__}.forward{sig}: the {backend} tap reads {' + '.join(params)}",
            **data,
        )
    return failed(
        GROUP,
        "layer forward",
        problem.split("; this layer class")[0],
        f"add {layer.__name__}'s family to eyas/workers/models/adapters.py: the {backend} tap needs "
        f"{' and '.join(params)} in the decoder layer's forward",
        **data,
    )


# --- vLLM's classes read from its source, without importing vLLM ---------------------------
#
# Importing a vLLM model module imports vLLM, torch and transformers: seconds, most of the
# doctor's time. classwalk needs classes, their MRO, their functions' source and globals, and
# signatures, not running code; so the model files are read as a stand-in: each vLLM module's
# top-level classes and functions are compiled from its own source (file and line numbers kept,
# so inspect reads the same text), decorators dropped but property/classmethod/staticmethod,
# names bound lazily on first use. Names from outside vLLM (torch, transformers, ...) are
# empty stand-in classes named as the real ones, torch.nn's module classes among them; nothing
# but the standard library is imported, and nothing is called (an expression that would call
# is left out). A stand-in that passes
# every adapter check is the answer; any other outcome is checked again on vLLM's real classes
# (check), so a finding is never the stand-in's.

_KEEP_DECORATORS = {"property", "classmethod", "staticmethod"}


def _none(where: ast.AST) -> ast.Constant:
    return ast.copy_location(ast.Constant(None), where)


def _calls(node: ast.AST) -> bool:
    """Whether evaluating `node` would call something (a stand-in or, worse, vLLM's code)."""
    return any(isinstance(n, ast.Call) for n in ast.walk(node))


_TORCH_MODULES = {
    f"torch.nn.{name}": type(name, (), {"__module__": "torch.nn"})
    for name in ("Module", "ModuleList", "ModuleDict", "Sequential")
}


def _package_dir(name: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec(name)
    locations = spec.submodule_search_locations if spec is not None else None
    return Path(locations[0]) if locations else None


class _Outside:
    """A module outside vLLM: its attributes are submodules (folders and files on disk) or
    stand-in classes of their dotted names."""

    _made: dict[str, Any] = {}

    def __init__(self, dotted: str, folder: Path | None):
        self._dotted, self._folder = dotted, folder

    @classmethod
    def get(cls, dotted: str) -> Any:
        if dotted not in cls._made:
            head, _, tail = dotted.rpartition(".")
            if dotted in _TORCH_MODULES:
                cls._made[dotted] = _TORCH_MODULES[dotted]
            elif not head:
                cls._made[dotted] = cls(dotted, _package_dir(dotted))
            else:
                parent = cls.get(head)
                folder = parent._folder if isinstance(parent, _Outside) else None
                if folder is not None and ((folder / tail).is_dir() or (folder / f"{tail}.py").exists()):
                    cls._made[dotted] = cls(dotted, folder / tail if (folder / tail).is_dir() else None)
                else:
                    cls._made[dotted] = type(tail, (), {"__module__": head})
        return cls._made[dotted]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(f"{self._dotted}.{name}")


class _Scope(dict):
    """Names looked up while compiling: this dict's own, else the module's."""

    def __init__(self, own: dict, module: _Globals):
        super().__init__(own)
        self.module = module

    def __missing__(self, name: str) -> Any:
        return self.module[name]


class _Globals(dict):
    """A stand-in module's globals: each top-level name is made when first looked up."""

    def __init__(self, reader: _StaticVllm, dotted: str, path: Path):
        super().__init__(__name__=dotted, __file__=str(path), __builtins__=builtins)
        self.reader, self.dotted, self.path = reader, dotted, path
        self.package = dotted if path.name == "__init__.py" else dotted.rpartition(".")[0]
        self.bindings: dict[str, ast.AST] = {}
        self._bind(ast.parse(path.read_text(encoding="utf-8"), str(path)).body)

    def _bind(self, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self.bindings.setdefault(node.name, node)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    name = alias.asname or alias.name.split(".")[0]
                    self.bindings.setdefault(name, ast.Import([alias]) if isinstance(node, ast.Import) else node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        self.bindings.setdefault(t.id, node)
            elif isinstance(node, ast.If):
                self._bind(node.body)
                self._bind(node.orelse)
            elif isinstance(node, ast.Try):
                self._bind(node.body)
                for handler in node.handlers:
                    self._bind(handler.body)

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self.bindings

    def __missing__(self, name: str) -> Any:
        if name not in self.bindings:
            raise KeyError(name)
        value = self._make(name, self.bindings[name])
        self[name] = value
        return value

    def _make(self, name: str, node: ast.AST) -> Any:
        if isinstance(node, ast.ClassDef):
            return self.reader.make_class(node, self)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return self.reader.make_function(node, self, {})
        if isinstance(node, ast.Import):
            alias = node.names[0]
            return self.reader.module(alias.name if alias.asname else alias.name.split(".")[0])
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = self.package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            attr = next(a.name for a in node.names if (a.asname or a.name) == name)
            return self.reader.import_from(base, attr)
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, (ast.Name, ast.Attribute)):  # an alias of another name
            return self.reader.evaluate(value, self, {})
        return type(name, (), {"__module__": self.dotted})


class _StaticVllm:
    """vLLM's model classes, read from the installed vLLM's source (see above)."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, Any] = {}
        self.classes: dict[tuple[str, str], type] = {}

    def module(self, dotted: str) -> Any:
        if dotted in self.modules:
            return self.modules[dotted]
        top = dotted.split(".")[0]
        if top in sys.stdlib_module_names:
            found = importlib.import_module(dotted)
        elif top != "vllm":
            found = _Outside.get(dotted)
        else:
            rel = self.root.joinpath(*dotted.split(".")[1:])
            path = rel / "__init__.py" if rel.is_dir() else rel.with_suffix(".py")
            if not path.exists():
                raise ImportError(f"no {dotted} in {self.root}")
            found = _Globals(self, dotted, path)
        self.modules[dotted] = found
        return found

    def import_from(self, base: str, attr: str) -> Any:
        module = self.module(base)
        if isinstance(module, _Globals):
            if attr in module:
                return module[attr]
            return self.module(f"{base}.{attr}")  # `from vllm.x import submodule`
        return getattr(module, attr)

    def evaluate(self, node: ast.expr, module: _Globals, own: dict) -> Any:
        code = compile(ast.fix_missing_locations(ast.Expression(node)), str(module.path), "eval", dont_inherit=True)
        return eval(code, module, _Scope(own, module))  # names and attributes only: nothing is called

    def make_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef, module: _Globals, own: dict) -> Any:
        """The function as its def statement makes it (defaults and annotations evaluated),
        its body never run."""
        node = copy.deepcopy(node)
        node.decorator_list = [d for d in node.decorator_list if isinstance(d, ast.Name) and d.id in _KEEP_DECORATORS]
        # Nothing may run: a default that calls something becomes None (only a class default,
        # such as Llama's layer_type, matters to classwalk), an annotation that does is dropped.
        args = node.args
        args.defaults = [_none(d) if _calls(d) else d for d in args.defaults]
        args.kw_defaults = [_none(d) if d is not None and _calls(d) else d for d in args.kw_defaults]
        for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
            if arg is not None and arg.annotation is not None and _calls(arg.annotation):
                arg.annotation = None
        if node.returns is not None and _calls(node.returns):
            node.returns = None
        scope = _Scope(own, module)
        tree = ast.Module([node], [])
        try:  # dont_inherit: not this module's `from __future__ import annotations`
            exec(compile(tree, str(module.path), "exec", dont_inherit=True), module, scope)
        except Exception:  # noqa: BLE001 - an annotation outside what the stand-ins model: kept as text
            flags = __future__.annotations.compiler_flag
            exec(compile(tree, str(module.path), "exec", flags=flags, dont_inherit=True), module, scope)
        return dict.__getitem__(scope, node.name)

    def make_class(self, node: ast.ClassDef, module: _Globals) -> type:
        key = (module.dotted, node.name)
        if key in self.classes:
            return self.classes[key]
        bases = []
        for expr in node.bases:
            expr = expr.value if isinstance(expr, ast.Subscript) else expr  # Base[T]: Base
            if _calls(expr):
                continue
            try:
                base = self.evaluate(expr, module, {})
            except Exception:  # noqa: BLE001 - an unresolvable base is left out; the check then fails and reruns
                continue
            if isinstance(base, type) and base is not typing.Generic:
                bases.append(base)
        body: dict[str, Any] = {"__module__": module.dotted, "__qualname__": node.name}
        for stmt in node.body:
            try:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    body[stmt.name] = self.make_function(stmt, module, body)
                elif isinstance(stmt, ast.ClassDef):
                    body[stmt.name] = self.make_class(stmt, module)
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    names = [t.id for t in targets if isinstance(t, ast.Name)]
                    if isinstance(stmt.value, (ast.Name, ast.Attribute, ast.Constant)):
                        value = self.evaluate(stmt.value, module, body)
                    else:
                        value = type(names[0] if names else "value", (), {"__module__": module.dotted})
                    body.update(dict.fromkeys(names, value))
            except Exception:  # noqa: BLE001 - a member the stand-ins cannot make is left out
                continue
        cls: type = object
        for tried in (bases, [b for b in bases if type(b) is type], []):  # then without metaclasses, then none
            try:
                cls = types.new_class(node.name, tuple(tried), exec_body=lambda ns: ns.update(body))
                break
            except TypeError:  # a metaclass conflict or a Protocol's rules: fewer bases
                continue
        self.classes[key] = cls
        return cls

    def registry(self) -> dict[str, tuple[str, str]]:
        """Architecture -> (module, class) from the literal tables that registry.py merges
        into _VLLM_MODELS, later tables overriding earlier ones as `{**a, **b}` does."""
        tree = ast.parse((self.root / "model_executor" / "models" / "registry.py").read_text(encoding="utf-8"))
        tables: dict[str, ast.Dict] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        tables[t.id] = node.value
        merged = tables.get("_VLLM_MODELS")
        order = [v.id for k, v in zip(merged.keys, merged.values) if k is None and isinstance(v, ast.Name)]
        found: dict[str, tuple[str, str]] = {}
        for name in order:
            table = tables.get(name)
            for k, v in zip(table.keys, table.values) if table is not None else ():
                if (
                    isinstance(k, ast.Constant)
                    and isinstance(v, ast.Tuple)
                    and len(v.elts) == 2
                    and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in v.elts)
                ):
                    found[k.value] = (v.elts[0].value, v.elts[1].value)
        return found

    def resolve(self, archs: list[str]) -> type | None:
        table = self.registry_table
        for arch in archs:
            if arch in table:
                module, name = table[arch]
                return self.import_from(f"vllm.model_executor.models.{module}", name)
        return None

    @functools.cached_property
    def registry_table(self) -> dict[str, tuple[str, str]]:
        return self.registry()


def static_vllm() -> _StaticVllm | None:
    """The stand-in reader of the installed vLLM, or None without one."""
    root = _package_dir("vllm")
    return _StaticVllm(root) if root is not None and (root / "model_executor" / "models").is_dir() else None


def _static_checks(facts: TargetFacts, adapter: adapters.Adapter) -> list[Check] | None:
    """The vllm adapter checks on the stand-in classes: the list when every one passes, else None."""
    try:
        reader_vllm = static_vllm()
        top = reader_vllm.resolve([facts.architecture]) if reader_vllm is not None else None
        if not isinstance(top, type):
            return None
        nn = _TORCH_MODULES
        reader = classwalk.ClassReader(
            nn["torch.nn.Module"],
            (nn["torch.nn.ModuleList"], nn["torch.nn.ModuleDict"], nn["torch.nn.Sequential"]),
            reader_vllm.resolve,
        )
        out = _checks(reader, top, adapter.decoder_paths + adapter.vllm_paths, adapter, facts.architecture, "vllm")
    except Exception:  # noqa: BLE001 - whatever the stand-ins cannot read, the real classes are read
        return None
    return out if all(c.verdict == "pass" for c in out) else None
