"""Which classes a model class builds, read from its source without building it.

`eyas doctor` checks an adapter against a backend's model classes without weights, without a
GPU and without vLLM's distributed set-up (which constructing any vLLM model needs), so it
reads `__init__` with `ast` instead of running it. It follows what model code does:
- `self.model = DeepseekV2Model(...)`: a class called by name (module globals, or the default
  of a parameter such as Llama's `layer_type=LlamaDecoderLayer`);
- `self.model = self.model_cls(...)`: a class attribute of the (concrete) class;
- `self.model = self._init_model(...)`: what that method returns;
- `self.language_model = init_vllm_registered_model(..., architectures=["X"])`: the class a
  resolver gives for those architectures (the doctor passes vLLM's model registry);
- `self.layers = make_layers(n, lambda prefix: Layer(...))` or
  `nn.ModuleList([Layer(...) for ...])`: for `element()`, the module class built inside.
Every class of the MRO is read, subclass first; the first assignment in source order wins.
A value it cannot follow is reported as unknown (never guessed); an attribute that no
`__init__` assigns is absent. Stdlib only: the classes come from the caller.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

FOUND, UNKNOWN, ABSENT = "found", "unknown", "absent"


@dataclass(frozen=True)
class Found:
    state: str  # found | unknown | absent
    cls: type | None = None
    how: str = ""  # how it was found, or why not

    @property
    def ok(self) -> bool:
        return self.state == FOUND


@functools.lru_cache(maxsize=512)
def _tree(fn: Callable) -> ast.AST | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _own(owner: type, name: str) -> Iterator[tuple[type, Callable]]:
    """(class, function) for each class of owner's MRO that defines `name` itself."""
    for klass in owner.__mro__:
        fn = klass.__dict__.get(name)
        if isinstance(fn, (staticmethod, classmethod)):
            fn = fn.__func__
        if inspect.isfunction(fn):
            yield klass, inspect.unwrap(fn)
            # Decorators that replace a method without functools.wraps keep the original in
            # their closure (vLLM's @support_torch_compile wraps __init__ so): read it too.
            for cell in fn.__closure__ or ():
                try:
                    inner = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                if inspect.isfunction(inner) and inner.__name__ == name:
                    yield klass, inspect.unwrap(inner)


def _is_self_attr(node: ast.AST, attr: str | None = None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and (attr is None or node.attr == attr)
    )


class ClassReader:
    """Reads model classes. `module_base` is the class every module derives from (torch's
    nn.Module); `containers` are module classes that only hold others (ModuleList...);
    `resolve_archs` maps a list of architecture names to a class (a registry), or None."""

    def __init__(
        self,
        module_base: type,
        containers: tuple[type, ...] = (),
        resolve_archs: Callable[[list[str]], type | None] | None = None,
    ):
        self.module_base = module_base
        self.containers = containers
        self.resolve_archs = resolve_archs

    # -- assignments in __init__ -----------------------------------------------------------

    def _assignments(self, owner: type, attr: str) -> Iterator[tuple[ast.AST, Callable]]:
        """(value expression, function it sits in) of each `self.<attr> = ...` in __init__,
        subclass first, and in the methods __init__ calls as `self.method(...)` statements."""
        for _klass, fn in _own(owner, "__init__"):
            yield from self._assignments_in(owner, fn, attr, depth=2)

    def _assignments_in(self, owner: type, fn: Callable, attr: str, depth: int):
        tree = _tree(fn)
        if tree is None:
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if _is_self_attr(target, attr):
                        yield node.value, fn
                    elif isinstance(target, ast.Tuple) and any(_is_self_attr(e, attr) for e in target.elts):
                        # a, b, self.layers = make_layers(...): the value holds the modules.
                        yield node.value, fn
            elif isinstance(node, ast.AnnAssign) and node.value is not None and _is_self_attr(node.target, attr):
                yield node.value, fn
            elif (
                depth
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Call)
                and _is_self_attr(node.value.func)
            ):
                for _klass, helper in _own(owner, node.value.func.attr):
                    yield from self._assignments_in(owner, helper, attr, depth - 1)
                    break

    def assigns(self, owner: type, attr: str) -> bool:
        return next(self._assignments(owner, attr), None) is not None

    # -- what an attribute holds ----------------------------------------------------------

    def attr(self, owner: type, attr: str) -> Found:
        """The class of `owner().<attr>`."""
        unknown = None
        for value, fn in self._assignments(owner, attr):
            found = self._value(value, fn, owner)
            if found.ok:
                return found
            unknown = unknown or found
        if unknown is not None:
            return unknown
        return Found(ABSENT, how=f"no __init__ of {owner.__name__} (or its bases) assigns self.{attr}")

    def returns(self, owner: type, method: str) -> Found:
        """The class of what `owner().<method>()` returns."""
        for _klass, fn in _own(owner, method):
            tree = _tree(fn)
            if tree is None:
                return Found(UNKNOWN, how=f"no source for {owner.__name__}.{method}")
            for node in ast.walk(tree):
                if isinstance(node, ast.Return) and node.value is not None:
                    found = self._value(node.value, fn, owner)
                    if found.ok:
                        return found
            return Found(UNKNOWN, how=f"{owner.__name__}.{method}() returns nothing this reader can follow")
        return Found(ABSENT, how=f"{owner.__name__} has no method {method}()")

    def element(self, owner: type, attr: str) -> Found:
        """The module class built inside `self.<attr> = ...` (the layer class of a ModuleList)."""
        seen = False
        for value, fn in self._assignments(owner, attr):
            seen = True
            for node in ast.walk(value):
                if isinstance(node, ast.Call):
                    callee = self._callee(node.func, fn, owner)
                    if self._is_module(callee):
                        return Found(FOUND, callee, f"built in self.{attr}")
        if not seen:
            return Found(ABSENT, how=f"no __init__ of {owner.__name__} (or its bases) assigns self.{attr}")
        return Found(UNKNOWN, how=f"self.{attr} of {owner.__name__} is built by code this reader cannot follow")

    def _is_module(self, value: Any) -> bool:
        return (
            isinstance(value, type) and issubclass(value, self.module_base) and not issubclass(value, self.containers)
        )

    # -- expressions -------------------------------------------------------------------------

    def _value(self, node: ast.AST, fn: Callable, owner: type) -> Found:
        if isinstance(node, ast.IfExp):
            found = self._value(node.body, fn, owner)
            return found if found.ok else self._value(node.orelse, fn, owner)
        if _is_self_attr(node):
            return self.attr(owner, node.attr)
        if not isinstance(node, ast.Call):
            return Found(UNKNOWN, how=f"{ast.unparse(node)[:60]} is not a call")
        archs = self._archs(node)
        if archs is not None and self.resolve_archs is not None:
            cls = self.resolve_archs(archs)
            return (
                Found(FOUND, cls, f"registry: {archs[0]}")
                if cls is not None
                else Found(UNKNOWN, how=f"no class registered for {archs}")
            )
        callee = self._callee(node.func, fn, owner)
        if isinstance(callee, type):
            return Found(FOUND, callee, ast.unparse(node.func))
        if _is_self_attr(node.func) and inspect.isfunction(callee):
            return self.returns(owner, node.func.attr)
        if inspect.isfunction(callee):
            found = self._returns_of(callee)
            if found.ok:
                return found
        return Found(UNKNOWN, how=f"cannot tell what {ast.unparse(node.func)}(...) builds")

    def _returns_of(self, fn: Callable) -> Found:
        tree = _tree(fn)
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                callee = self._callee(node.value.func, fn, object)
                if self._is_module(callee):
                    return Found(FOUND, callee, f"returned by {fn.__name__}()")
        return Found(UNKNOWN)

    @staticmethod
    def _archs(call: ast.Call) -> list[str] | None:
        """`architectures=["X", ...]` of a registry call, as a list of names."""
        for kw in call.keywords:
            if kw.arg == "architectures" and isinstance(kw.value, (ast.List, ast.Tuple)):
                names = [e.value for e in kw.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                return names or None
        return None

    def _callee(self, node: ast.AST, fn: Callable, owner: type) -> Any:
        """The object a call's function expression names, or None."""
        if isinstance(node, ast.Name):
            return self._name(node.id, fn)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return getattr(owner, node.attr, None)
            base = self._callee(node.value, fn, owner)
            return getattr(base, node.attr, None) if base is not None else None
        return None

    @staticmethod
    def _name(name: str, fn: Callable) -> Any:
        try:
            param = inspect.signature(fn).parameters.get(name)
        except (TypeError, ValueError):
            param = None
        if param is not None:
            return None if param.default is inspect.Parameter.empty else param.default
        scope = getattr(fn, "__globals__", {})
        if name in scope:
            return scope[name]
        return getattr(builtins, name, None)


def path_class(reader: ClassReader, top: type, path: str) -> Found:
    """The class reached from `top` along an adapter path ("language_model.model",
    "get_language_model().model"); the same segments adapters._resolve follows on a model."""
    cls = top
    how = []
    for part in path.split(".") if path else ():
        found = reader.returns(cls, part[:-2]) if part.endswith("()") else reader.attr(cls, part)
        if not found.ok:
            return Found(found.state, None, f"{cls.__name__}.{part}: {found.how}")
        cls = found.cls
        how.append(cls.__name__)
    return Found(FOUND, cls, " -> ".join(how))
