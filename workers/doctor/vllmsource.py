"""vLLM's model classes read from the installed vLLM's source without importing vLLM: stand-in classes that the doctor's adapter check (adapter.py) walks as it walks the real ones.

Importing a vLLM model module imports vLLM, torch and transformers: seconds, most of the
doctor's time. classwalk needs classes, their MRO, their functions' source and globals, and
signatures, not running code; so the model files are read as a stand-in: each vLLM module's
top-level classes and functions are compiled from its own source (file and line numbers kept,
so inspect reads the same text), decorators dropped but property/classmethod/staticmethod,
names bound lazily on first use. Names from outside vLLM (torch, transformers, ...) are
empty stand-in classes named as the real ones, torch.nn's module classes among them; nothing
but the standard library is imported, and nothing is called (an expression that would call
is left out). A stand-in that passes every adapter check is the answer; any other outcome is
checked again on vLLM's real classes (adapter.check), so a finding is never the stand-in's.
"""

from __future__ import annotations
import __future__

import ast
import builtins
import copy
import functools
import importlib
import importlib.machinery
import sys
import types
import typing
from pathlib import Path
from typing import Any

_KEEP_DECORATORS = {"property", "classmethod", "staticmethod"}


def _none(where: ast.AST) -> ast.Constant:
    return ast.copy_location(ast.Constant(None), where)


def _calls(node: ast.AST) -> bool:
    """Whether evaluating `node` would call something (a stand-in or, worse, vLLM's code)."""
    return any(isinstance(n, ast.Call) for n in ast.walk(node))


# torch.nn's module classes as stand-ins: the base and the containers a ClassReader walks.
TORCH_MODULES = {
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
            if dotted in TORCH_MODULES:
                cls._made[dotted] = TORCH_MODULES[dotted]
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
