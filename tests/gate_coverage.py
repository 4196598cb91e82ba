"""A pytest plugin for tests/unit/test_gpu_gate.py: at collection, writes to the file named by
FUSEDALIGN_GATE_REPORT every test that is skipped here for want of CUDA or Triton and that
carries neither the `gpu` nor the `cuda_path` mark, so that scripts/gpu_tests.sh
(`-m "gpu or cuda_path"`) would never run it either. One line each, in these forms:

- a `skipif` whose condition holds here (a bool, or a string evaluated as pytest does), or a
  `skip` mark, whose reason names a device (CUDA, a GPU, an accelerator, NVIDIA, Triton,
  bf16/bfloat16, flash attention);
- a whole module skipped at collection (a module-level `pytest.importorskip("triton")` or
  `pytest.skip(..., allow_module_level=True)`) for such a reason, unless its `pytestmark`
  names `gpu` or `cuda_path`;
- a `pytest.skip(...)` or `pytest.importorskip(...)` in the test's body, or in a module-level
  function or fixture it calls or requests (followed three deep), for such a reason (the
  importorskip of a device package: triton, flash_attn, ...), unless the `if` around it is
  false here or the imports whose failure it handles succeed. An `if` that cannot be evaluated
  at collection (it reads a local value) counts as true: the test may skip, so it belongs in
  the gate.

A skip when CUDA *is* present ("CUDA present: tested compiled above") is not a want of one:
its condition is false here.
"""

from __future__ import annotations

import ast
import functools
import importlib
import os
import re

WANTS_A_DEVICE = re.compile(r"cuda|gpu|accelerator|nvidia|triton|bf16|bfloat16|flash.?attn", re.IGNORECASE)
DEVICE_PACKAGES = {"triton", "flash_attn", "cupy", "pynvml", "apex"}
IN_GATE = ("gpu", "cuda_path")
DEPTH = 3  # helpers followed from a test: its fixtures, what they call, and once more

_orphans: list[str] = []


def pytest_collectreport(report):
    """A module skipped whole at collection: its tests never become items."""
    if not report.skipped or not isinstance(report.longrepr, tuple) or not str(report.fspath).endswith(".py"):
        return
    reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    if WANTS_A_DEVICE.search(reason) and not _module_in_gate(str(report.fspath)):
        _orphans.append(f"{report.nodeid or report.fspath} (module skipped: {reason})")


def pytest_collection_modifyitems(items):
    for item in items:
        if any(any(item.iter_markers(name)) for name in IN_GATE):
            continue
        for why in _mark_skips(item) + _body_skips(item):
            _orphans.append(f"{item.nodeid} (skipped: {why})")


def pytest_collection_finish(session):
    with open(os.environ["FUSEDALIGN_GATE_REPORT"], "w") as report:
        report.write("\n".join(_orphans))


# ------------------------------------------------------------------------------ marks


def _mark_skips(item) -> list[str]:
    from _pytest.skipping import evaluate_condition

    found = []
    for mark in item.iter_markers("skip"):
        reason = str(mark.kwargs.get("reason", mark.args[0] if mark.args else ""))
        if WANTS_A_DEVICE.search(reason):
            found.append(reason)
    for mark in item.iter_markers("skipif"):
        reason = str(mark.kwargs.get("reason", ""))
        conditions = mark.args or ((mark.kwargs["condition"],) if "condition" in mark.kwargs else ())
        for condition in conditions:
            try:
                holds, _ = evaluate_condition(item, mark, condition)
            except BaseException:  # noqa: BLE001 - pytest reports it when it runs the test
                continue
            if holds and WANTS_A_DEVICE.search(reason + (condition if isinstance(condition, str) else "")):
                found.append(reason)
                break
    return found


@functools.lru_cache(maxsize=None)
def _tree(path: str) -> ast.Module | None:
    try:
        with open(path, encoding="utf-8") as f:
            return ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _module_in_gate(path: str) -> bool:
    """Whether the module's `pytestmark` names gpu or cuda_path (read from its source: it was not imported)."""
    tree = _tree(path)
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and node.value is not None:
                if any(re.search(rf"\b{name}\b", ast.unparse(node.value)) for name in IN_GATE):
                    return True
    return False


# ------------------------------------------------------------------------------ skips in bodies


def _body_skips(item) -> list[str]:
    """Skips in the test function, its fixtures and the module's functions they call, that may happen here."""
    module, function = getattr(item, "module", None), getattr(item, "originalname", None) or item.name
    tree = _tree(getattr(module, "__file__", "") or "")
    if tree is None:
        return []
    functions = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and getattr(item, "cls", None) is not None and node.name == item.cls.__name__:
            functions.update({f"{node.name}.{m.name}": m for m in node.body
                              if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))})
            function = f"{node.name}.{function}"
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    found, seen, todo = [], set(), [(function, 0)]
    while todo:
        name, depth = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        node = functions[name]
        scope = {**vars(module), **(params if name == function else {})}
        for call, guards in _skip_calls(node.body, []):
            why = _device_reason(call, guards)
            if why is not None and _may_happen(call, guards, scope):
                found.append(why if name == function else f"{why} (in {name})")
        if depth < DEPTH:
            used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {a.arg for a in node.args.args}
            todo += [(n, depth + 1) for n in used if n in functions]
    return found


def _skip_calls(body: list[ast.stmt], guards: list):
    """(call, guards) for each pytest.skip / pytest.importorskip call in `body`; a guard is
    (an if's test, the branch taken) or ("except", the try statement)."""
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue  # a function of its own: followed when it is called by name
        if isinstance(stmt, ast.If):
            yield from _skip_calls(stmt.body, guards + [(stmt.test, True)])
            yield from _skip_calls(stmt.orelse, guards + [(stmt.test, False)])
            continue
        if isinstance(stmt, ast.Try) or type(stmt).__name__ == "TryStar":
            yield from _skip_calls(stmt.body, guards)
            for handler in stmt.handlers:
                yield from _skip_calls(handler.body, guards + [("except", stmt)])
            yield from _skip_calls(stmt.orelse + stmt.finalbody, guards)
            continue
        if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith)):
            yield from _skip_calls(stmt.body + getattr(stmt, "orelse", []), guards)
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and _skip_kind(node) is not None:
                yield node, guards


def _skip_kind(call: ast.Call) -> str | None:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "pytest" \
        else f.id if isinstance(f, ast.Name) else None
    return name if name in ("skip", "importorskip") else None


def _text(node: ast.AST | None) -> str:
    """A reason's words: a string's value, an f-string's literal parts, else the expression's source."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(str(v.value) if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return ast.unparse(node)


def _argument(call: ast.Call, position: int, name: str) -> ast.AST | None:
    if len(call.args) > position:
        return call.args[position]
    return next((k.value for k in call.keywords if k.arg == name), None)


def _device_reason(call: ast.Call, guards: list) -> str | None:
    """The skip's reason, if it is for want of a device (its words, its package, or the `if` around it)."""
    if _skip_kind(call) == "importorskip":
        package = _text(_argument(call, 0, "modname"))
        reason = _text(_argument(call, 2, "reason"))
        if package.split(".")[0] in DEVICE_PACKAGES or WANTS_A_DEVICE.search(reason):
            return f"importorskip({package!r})"
        return None
    reason = _text(_argument(call, 0, "reason"))
    guard_words = " ".join(ast.unparse(g[0]) for g in guards if g[0] != "except")
    return reason if WANTS_A_DEVICE.search(reason) or WANTS_A_DEVICE.search(guard_words) else None


def _may_happen(call: ast.Call, guards: list, scope: dict) -> bool:
    """False when an `if` around the skip is false here, the imports an `except` around it handles
    succeed, or (importorskip) the package imports; True otherwise, also when that cannot be told."""
    for guard, branch in guards:
        if guard == "except":
            if _imports_succeed(branch.body):
                return False
            continue
        try:
            if bool(eval(compile(ast.Expression(guard), "<guard>", "eval"), dict(scope))) != branch:  # noqa: S307
                return False
        except Exception:  # noqa: BLE001 - a local value: it may happen
            continue
    if _skip_kind(call) == "importorskip":
        package = _argument(call, 0, "modname")
        if isinstance(package, ast.Constant) and _imports_succeed([ast.Import(names=[ast.alias(package.value)])]):
            return False
    return True


def _imports_succeed(body: list[ast.stmt]) -> bool:
    """Whether `body` is imports only and each succeeds here."""
    if not body or not all(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body):
        return False
    try:
        for stmt in body:
            if isinstance(stmt, ast.Import):
                for alias in stmt.names:
                    importlib.import_module(alias.name)
            elif stmt.level == 0 and stmt.module:
                module = importlib.import_module(stmt.module)
                for alias in stmt.names:
                    if not hasattr(module, alias.name):
                        importlib.import_module(f"{stmt.module}.{alias.name}")
            else:
                return False
    except Exception:  # noqa: BLE001 - ImportError and whatever a broken package raises
        return False
    return True
