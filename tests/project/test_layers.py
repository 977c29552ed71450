"""The package's layers point one way: a module imports only modules of its own layer or below,
and no imports form a cycle.  Every import counts, those inside functions too; only imports under
``if TYPE_CHECKING:`` (types for annotations) are exempt.  A new module must be given a layer here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "celery_threads"

#: Bottom to top.  A module is named by its path under the package, without ``.py``.
LAYERS: list[tuple[str, set[str]]] = [
    (
        "base: errors, signals, names, settings, adapters of other libraries",
        {
            "errors",
            "logs",
            "signals",
            "keys",
            "protocol",
            "config",
            "redis_options",
            "seams",
            "metrics",
            "policies",
        },
    ),
    (
        "the gate: its Lua, loader, records and client",
        {
            "gate",
            "gate.records",
            "gate.replies",
            "gate.library",
            "gate.client",
            "gate.wire",
            "gate.reads",
            "gate.transitions",
            "gate.access",
            "gate.eviction",
            "gate.cluster",
            "gate.sentinel",
            "gate.deadline",
            "gate.transport",
        },
    ),
    ("publishing", {"publish"}),
    ("the per-process runtime and the dispatcher", {"runtime", "dispatcher"}),
    (
        "the worker side",
        {
            "worker",
            "worker.bootstep",
            "worker.strategy",
            "worker.request",
            "worker.revoke",
            "worker.processes",
            "worker.renewer",
            "worker.lease",
            "worker.shared",
            "worker.native",
            "worker.handoff",
            "worker.noack",
            "worker.member",
        },
    ),
    ("the wiring", {"install"}),
    ("the task class", {"task"}),
    (
        "the admin API, the CLI, the exporter and the package's public names",
        {"admin", "cli", "exporter", "__init__"},
    ),
]


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        found[name] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports (anywhere but under ``TYPE_CHECKING``)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if name == "__init__":
        package = []
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            elif node.module and node.module.split(".")[0] == "celery_threads":
                base = []
                node = ast.ImportFrom(
                    module=".".join(node.module.split(".")[1:]) or None, names=node.names, level=1
                )
            else:
                return
            target = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # ``from . import x`` names a module when x is one
                candidate = ".".join(target + [alias.name])
                found.add(candidate if candidate in known else ".".join(target) or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "celery_threads":
                    found.add(".".join(alias.name.split(".")[1:]) or "__init__")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    found.discard(name)
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}


def layer_of(name: str) -> int:
    for index, (_, members) in enumerate(LAYERS):
        if name in members:
            return index
    raise AssertionError(f"module {name} has no layer: add it to LAYERS in {__file__}")


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_no_module_imports_a_layer_above_its_own():
    upward = [
        f"{name} ({LAYERS[layer_of(name)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for name, targets in graph().items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                walk(target, path + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            walk(node, [node])
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_checker_sees_imports_inside_functions():
    """The check itself: an import inside a function is found (one the package has)."""
    assert "worker.bootstep" in graph()["install"]
