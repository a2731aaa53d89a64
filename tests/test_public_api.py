"""ray_zero uses Ray's public API only: no `_internal` or `_private` module is named anywhere in the
package (import, attribute, or a string handed to importlib), and no Ray Train class is subclassed to
override its underscore methods. Ray Train V2 changes under those names, and users run other Ray versions."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ray_zero"
PRIVATE = ("_internal", "_private", "_raylet")


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _private_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] + [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute):
            names = [_dotted(node)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("ray."):
            names = [node.value]
        for name in names:
            parts = name.split(".")
            if (parts[0] == "ray" or isinstance(node, (ast.ImportFrom,))) and any(
                p in PRIVATE for p in parts
            ):
                found.append(f"line {node.lineno}: {name}")
    return found


def _ray_train_subclasses_overriding_privates(tree: ast.AST, imported: dict[str, str]) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = [imported.get(_dotted(b), _dotted(b)) for b in node.bases]
            if any(b.startswith("ray.train") or b.startswith("ray.tune.trainable") for b in bases):
                private = [
                    f.name
                    for f in node.body
                    if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and f.name.startswith("_")
                    and not f.name.startswith("__")
                ]
                if private:
                    found.append(f"class {node.name} overrides {private}")
    return found


def _imports(tree: ast.AST) -> dict[str, str]:
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def test_no_private_ray_module_and_no_overridden_train_internals():
    problems = []
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 10
    for path in modules:
        tree = ast.parse(path.read_text())
        problems += [f"{path.name}: {p}" for p in _private_uses(tree)]
        problems += [
            f"{path.name}: {p}" for p in _ray_train_subclasses_overriding_privates(tree, _imports(tree))
        ]
    assert problems == []


def test_the_check_catches_each_kind_of_private_use():
    samples = {
        "from ray.train.v2._internal.execution.controller import TrainController": 1,
        "import ray._private.worker": 1,
        "import ray\nurl = ray._private.worker.get_dashboard_url()": 1,
        "import importlib\nimportlib.import_module('ray.data._internal.x')": 1,
        "from ray.train import UserCallback\nclass C(UserCallback):\n    def after_report(self): pass": 0,
    }
    for code, expected in samples.items():
        assert bool(_private_uses(ast.parse(code))) == bool(expected), code
    code = "from ray.train.torch import TorchTrainer\nclass T(TorchTrainer):\n    def _initialize(self): pass"
    tree = ast.parse(code)
    assert _ray_train_subclasses_overriding_privates(tree, _imports(tree))
