"""The import graph: every package imports only the floors below it, modules import at top, no cycles.

Floors, bottom up (a package may use the ones listed for it, and what those use):

* ``protocol``, ``records``, ``devices``, ``hf``, ``diffusion``, ``corpora``, ``config``: leaves;
* ``nn`` (networks) and ``sampling`` (the reverse process), which never see each other;
* ``training``; ``specs`` (what a model or tokenizer string names);
* ``eval`` and ``posttrain``; ``study`` and ``tasks``; ``cli`` at the top.

The check reads every ``import`` in the source, those inside functions included, so a deferred
import cannot hide an edge; deferred imports are allowed only for optional dependencies.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tadm"

LEAVES = ("protocol", "records", "devices", "hf", "diffusion", "corpora", "config")
USES: dict[str, set[str]] = {
    **{leaf: set() for leaf in LEAVES},
    "nn": {"protocol", "hf"},
    "sampling": {"diffusion", "protocol"},
    "training": {"config", "corpora", "devices", "diffusion", "nn", "records"},
    "specs": {"devices", "hf", "nn", "training"},
    "eval": {"devices", "diffusion", "hf", "nn", "protocol", "records", "sampling", "specs", "training"},
    "posttrain": {"config", "devices", "diffusion", "hf", "nn", "protocol", "records", "sampling", "specs",
                  "training"},
    "study": {"config", "devices", "eval", "nn", "protocol", "records", "sampling", "specs", "training"},
    "tasks": {"devices", "eval", "hf", "posttrain", "records", "sampling", "specs"},
    "cli": {"config", "devices", "eval", "hf", "nn", "posttrain", "protocol", "records", "sampling", "specs",
            "study", "tasks", "training"},
}
# third-party packages a function may import on first use: optional extras, never the core requirements
OPTIONAL = ("transformers", "lm_eval", "mauve", "matplotlib", "datasets", "pyarrow", "math_verify",
            "torch.utils.tensorboard")
# the one core requirement imported on first use: scipy.stats takes about 0.6 s to import, which every `tadm`
# command would pay at start-up, and only the paired comparisons (tadm.eval.significance) use it
DEFERRED_CORE = ("scipy",)
# what importing the command line must not load (each is imported by the command that needs it)
HEAVY = (*OPTIONAL, *DEFERRED_CORE, "sklearn", "faiss")


def closure(package: str) -> set[str]:
    seen, todo = set(), [package]
    while todo:
        for used in USES[todo.pop()]:
            if used not in seen:
                seen.add(used)
                todo.append(used)
    return seen


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


def imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Absolute names an import statement loads (``from X import y`` gives ``X.y``; it may be a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" for alias in node.names]


def sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.name != "__main__.py")


def floor(name: str) -> str | None:
    """The floor (package or top-level module) of a dotted name under tadm; None for others and for
    attributes of the root package (``tadm.__version__``)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "tadm" and len(parts) > 1 and parts[1] in USES else None


def guarded(tree: ast.AST) -> set[int]:
    """Imports inside ``try`` blocks that catch ImportError: optional by construction."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any("ImportError" in ast.unparse(h.type or ast.Name("BaseException"))
                                             for h in node.handlers):
            found |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return found


def test_the_floors_cover_every_package():
    packages = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
                if (p.suffix == ".py" and p.stem not in ("__init__", "__main__")) or (p / "__init__.py").is_file()}
    assert packages == set(USES), f"floors missing for {sorted(packages - set(USES))}"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(SRC)))
def test_every_import_of_a_module_stays_within_its_floors(path):
    module = module_name(path)
    own = floor(module)
    allowed = closure(own) | {own} if own is not None else set()  # the root package imports no floor
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wrong, deferred = [], []
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inner = {id(n) for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    inner -= guarded(tree)
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for name in imported(node, module, path.name == "__init__.py"):
            used = floor(name)
            if used is not None and used not in allowed:
                wrong.append(f"line {node.lineno}: {name} ({used} is not below {own})")
            optional = any(name == o or name.startswith(o + ".") for o in OPTIONAL + DEFERRED_CORE)
            if id(node) in inner and not optional:
                deferred.append(f"line {node.lineno}: {name}")
    assert not wrong, f"{module} reaches above its floor: {wrong}"
    assert not deferred, f"{module} imports inside a function what it could import at the top: {deferred}"


@pytest.mark.slow
def test_no_import_cycle_between_modules():
    modules = {module_name(p): p for p in sources()}
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in imported(node, module, path.name == "__init__.py"):
                    target = name if name in modules else name.rpartition(".")[0]
                    if target in modules and target != module:
                        edges[module].add(target)
    # a depth-first search for a back edge
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(edges[module]):
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)) is not None:
                return cycle
        state[module] = 2
        stack.pop()
        return None

    for module in sorted(modules):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


@pytest.mark.slow
@pytest.mark.parametrize("package", sorted(USES))
def test_importing_a_package_loads_only_its_floors(package):
    code = (
        f"import importlib, json, sys; importlib.import_module('tadm.{package}'); "
        "print(json.dumps(sorted({m.split('.')[1] for m in sys.modules if m.startswith('tadm.')})))"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    assert loaded - {package} <= closure(package), f"tadm.{package} loads {sorted(loaded - {package} - closure(package))}"


def test_importing_the_command_line_loads_no_heavy_package():
    """`tadm` starts without transformers, lm-eval, matplotlib, datasets or scipy: the subcommands import them
    when they run (a Ctrl-C at start-up and every command's start pay only for torch)."""
    code = ("import json, sys; import tadm.cli; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    heavy = {name.split(".")[0] for name in HEAVY if name.split(".")[0] != "torch"}
    assert not loaded & heavy, f"importing tadm.cli loads {sorted(loaded & heavy)}"
