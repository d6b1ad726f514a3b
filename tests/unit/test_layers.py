"""Imports run one way: the layer order of ``src/`` below, written down once and checked on every module's imports
(those inside functions too). A module may import its own layer and the layers below it, never one above: the
message names the import that runs up. A new package gets a row here, where it belongs."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

LAYERS: list[tuple[str, ...]] = [
    ("ndparallel.errors", "ndparallel._compat"),  # one-line errors; the only touch of private torch APIs
    ("ndparallel.safe_io",),  # files and the hub, read and written safely
    ("ndparallel.kernels",),  # Triton kernels
    ("ndparallel.models",),  # family knowledge; no distributed code
    ("ndparallel.mesh",),  # sizes -> Layout -> Topology
    ("ndparallel.quantized",),  # NF4 and int8 base weights
    ("ndparallel.loss",),  # the token loss: cross-entropy, fused with lm_head, the LossHead
    ("ndparallel.adapters",),  # LoRA, unfrozen weights, QAT
    ("ndparallel.parallel",),  # one module per strategy, the rules of what composes, parallelize
    ("ndparallel.checkpoint",),  # save and resume, trusting nothing read
    ("ndparallel.weights",),  # meta init, sharded loading, pretrained, export
    ("ndparallel.step",),  # what one step computes: batch, loss, router loss, FLOPs
    ("ndparallel.optim",),  # AdamW variants, each owning its clipping
    ("ndparallel.data",),  # datasets -> cached rows -> a per-rank order
    ("ndparallel.config",),  # the schema, its rules, the Axolotl and Accelerate readers
    ("ndparallel.planner",),  # which layout, and why
    ("ndparallel.train",),  # the loop and everything around it
    ("ndparallel.testing",),  # helpers of the tests and the benchmarks (ranks on CPU, memory probes)
    ("ndparallel.validate", "ndparallel.launch"),  # `validate`; one node's processes
    ("ndparallel.cli", "ndparallel_cli"),  # the commands
]
PUBLIC = "ndparallel"  # the public API (``import ndparallel as ndp``) re-exports from any layer


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _layer(module: str) -> int | None:
    for index, names in enumerate(LAYERS):
        if any(module == name or module.startswith(name + ".") for name in names):
            return index
    return None


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of ours in ``path``, at any depth."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return [(line, name) for line, name in found if name.split(".")[0] in ("ndparallel", "ndparallel_cli")]


def test_every_module_has_a_layer():
    missing = [m for m in _modules() if m != PUBLIC and _layer(m) is None]
    assert not missing, f"modules in no layer (add them to LAYERS in {Path(__file__).name}): {missing}"


def test_no_import_runs_up():
    upward = []
    for module, path in _modules().items():
        if module == PUBLIC:
            continue
        mine = _layer(module)
        for line, name in _imports(module, path):
            theirs = _layer(name)
            if theirs is not None and theirs > mine:
                upward.append(
                    f"{path.relative_to(SRC)}:{line} {module} (layer {mine}, {LAYERS[mine][0]}) imports {name} "
                    f"(layer {theirs}, {LAYERS[theirs][0]})"
                )
    assert not upward, "imports that run up:\n" + "\n".join(upward)


def test_package_inits_hold_a_docstring_and_no_import():
    """A package's ``__init__`` says what it holds and what it may import, and imports nothing itself (a
    re-export there would tie every module of the package to every other)."""
    problems = []
    for module, path in _modules().items():
        if path.name != "__init__.py" or module in (PUBLIC, "ndparallel_cli"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if not ast.get_docstring(tree):
            problems.append(f"{module}: no docstring")
        if any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in ast.walk(tree)):
            problems.append(f"{module}: imports in __init__.py")
    assert not problems, problems
