"""The product packages' shape: their modules import only their own layer or lower ones (``LAYERS``),
with no import cycle among them, the decode step's side never sees a request, and no module is over
400 lines.

Read from the source (AST), nothing is imported: every ``import`` and ``from ... import`` counts,
at module level and inside functions alike, except those under ``if TYPE_CHECKING:`` (they never
run). ``from package import name`` is an import of ``package.name`` where that is a module.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO_ROOT

PACKAGES = ("engine", "kv_transfer", "deployments")
MAX_LINES = 400

# The layers, lowest first: a module may import modules of its own layer or of lower ones, never of
# a higher one. A module's layer is that of the longest prefix here that names it or a package above it.
LAYERS: list[tuple[str, ...]] = [
    ("engine.types", "engine.errors", "engine.arith", "engine.device"),  # host <-> device copies
    ("engine.kernels",),
    ("engine.kv",),  # blocks and their tensors: no decoding
    ("engine.attention",),
    ("engine.config",),
    ("engine.model",),
    ("engine.encode", "engine.decode.batch"),  # the batch: what crosses from scheduler to step
    ("engine.decode.step",),  # a batch of rows in, a step's output out: never a request
    (
        "engine.decode.request",
        "engine.decode.prompt",
        "engine.decode.fallback",
        "engine.decode.alignment",
        "engine.decode.results",
        "engine.decode.inbox",
        "engine.decode.kv_loader",
        "engine.decode.timings",
        "engine.decode.heap",
    ),
    ("engine.decode.search",),
    ("engine.decode.scheduler",),  # the only writer of a request's state
    ("engine.decode",),  # the engine: submit, abort, step, stats
    ("engine.transcribe",),
    ("engine.diarize",),  # speaker turns: finds speech with engine.transcribe's policy
    ("engine",),  # the public API
    ("kv_transfer",),
    ("deployments",),  # the replicas' deployments, their config, placement and stats
    ("deployments.orchestration",),  # a request's windows and a live turn's passes: no protocol
    # The protocol (routes, forms, formats, realtime), calling orchestration; and the models the
    # routes reach, each a pipeline with its readiness and accepted options in http's terms.
    ("deployments.http", "deployments.served_models"),
    ("deployments.ingress",),  # the HTTP deployment: ties the routes to the served models
    ("deployments.app",),  # the app builder: every deployment, bound into one application
]
# The step side: what imports neither a request nor the scheduler.
STEP_SIDE = ("engine.decode.batch", "engine.decode.step")
# The only writers of a request's state: the scheduler, and Request's own methods.
REQUEST_WRITERS = ("engine/decode/scheduler/", "engine/decode/request.py")
# Methods that change a list or a dict in place.
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "update", "setdefault", "sort", "reverse"}


def module_files() -> dict[str, Path]:
    """Every module of the packages, by dotted name (a package by its own name, not ``__init__``)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    """Every Import and ImportFrom, however deeply nested, outside ``if TYPE_CHECKING:`` blocks."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if _is_type_checking_block(node):
            children = list(node.orelse)
        pending.extend(children)


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The packages' modules that module ``name`` (at ``path``) imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a non-module c: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (its modules in import order, the first again at the end) per strongly connected
    component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_within(graph, component) for component in components]


def _cycle_within(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the component's first module, by breadth-first search."""
    start = min(component)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for successor in sorted(graph[node] & component):
                if successor == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if successor not in came_from:
                    came_from[successor] = node
                    following.append(successor)
        frontier = following
    raise AssertionError(f"no cycle in the strongly connected component {sorted(component)}")


def test_the_cycle_finder_reports_each_cycle_with_its_modules_in_import_order():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert sorted(import_cycles(graph)) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_the_import_graph_sees_function_level_and_submodule_imports():
    graph = import_graph()
    assert set(graph) >= {"engine", "engine.decode.engine", "kv_transfer", "deployments.app"}
    # kv_transfer/__init__.py imports its connectors inside make_sender / make_receiver.
    assert {"kv_transfer.nixl", "kv_transfer.local", "kv_transfer.base"} <= graph["kv_transfer"]


def test_the_packages_import_one_another_without_a_cycle():
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names ``module`` or a package above it."""
    best, best_length = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    if best is None:
        raise AssertionError(f"{module} is in no layer of LAYERS: add it to one")
    return best


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a module of a higher layer than the importer's, as ``importer -> imported``."""
    return [
        f"{module} -> {imported}"
        for module in sorted(graph)
        for imported in sorted(graph[module])
        if layer_of(imported) > layer_of(module)
    ]


def test_the_layer_finder_takes_the_longest_prefix_and_reports_imports_of_a_higher_layer():
    assert layer_of("engine.decode.step.pipeline") == layer_of("engine.decode.step")
    assert layer_of("engine.decode.step.pipeline") < layer_of("engine.decode.request")
    assert layer_of("engine.decode.engine") == layer_of("engine.decode")
    graph = {"engine.kv.storage": {"engine.decode.request"}, "engine.decode.request": {"engine.kv.storage"}}
    assert upward_arrows(graph) == ["engine.kv.storage -> engine.decode.request"]
    assert layer_of("deployments.http_limits") == layer_of("deployments.config")
    assert layer_of("deployments.orchestration.channels") < layer_of("deployments.http.audio_ingest")


def test_every_import_points_to_the_importers_layer_or_a_lower_one():
    arrows = upward_arrows(import_graph())
    assert not arrows, "imports of a higher layer:\n" + "\n".join(arrows)


def test_the_step_side_imports_neither_a_request_nor_the_scheduler():
    graph = import_graph()
    forbidden = ("engine.decode.request", "engine.decode.scheduler")
    found = [
        f"{module} -> {imported}"
        for module in sorted(graph)
        if module.startswith(STEP_SIDE)
        for imported in sorted(graph[module])
        if imported.startswith(forbidden)
    ]
    assert not found, "the step side imports the scheduler's side:\n" + "\n".join(found)


def test_no_module_of_the_packages_imports_under_type_checking():
    """An import only a type checker runs is an arrow all the same: none hides a cycle or an upward one."""
    hidden = [
        str(path.relative_to(REPO_ROOT))
        for path in module_files().values()
        if any(_is_type_checking_block(node) for node in ast.walk(ast.parse(path.read_text())))
    ]
    assert not hidden, f"modules with imports under TYPE_CHECKING: {hidden}"


def test_no_module_of_the_packages_is_over_400_lines():
    sizes = {
        str(path.relative_to(REPO_ROOT)): len(path.read_text().splitlines())
        for path in module_files().values()
    }
    too_long = {path: lines for path, lines in sorted(sizes.items()) if lines > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"


def request_fields() -> set[str]:
    """The fields of engine/decode/request.py's ``Request`` (its annotated class attributes)."""
    tree = ast.parse((REPO_ROOT / "engine/decode/request.py").read_text())
    (request,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Request"]
    return {node.target.id for node in request.body if isinstance(node, ast.AnnAssign)}


def writes_of_fields(source: str, fields: set[str]) -> list[tuple[int, str]]:
    """Where ``source`` changes ``<x>.<field>`` (or something under it: ``<x>.blocks.self_block_ids``)
    for an ``<x>`` other than ``self``: assigned, augmented, deleted, or changed in place by a list's
    or dict's method. (A class's own ``self.<name>`` is its own state, whatever the name.)"""

    def written_field(target: ast.AST) -> str | None:
        while isinstance(target, (ast.Attribute, ast.Subscript)):
            if isinstance(target, ast.Attribute) and target.attr in fields:
                root = target.value
                return None if isinstance(root, ast.Name) and root.id == "self" else target.attr
            target = target.value
        return None

    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = [t for target in node.targets for t in getattr(target, "elts", [target])]
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
        ):
            targets = [node.func.value]
        for target in targets:
            field = written_field(target)
            if field is not None:
                found.append((node.lineno, field))
    return found


def test_the_write_finder_sees_assignments_and_in_place_changes_of_anothers_fields():
    source = (
        "request.pending_tokens = [1]\n"
        "hypothesis.unread_tokens -= 1\n"
        "window.output_tokens.append(3)\n"
        "request.blocks.self_block_ids = []\n"
        "a, window.language = 1, 'en'\n"
        "self.pending_tokens = []\n"  # a class's own field of that name
        "tokens = request.output_tokens\n"  # a read
    )
    fields = {"pending_tokens", "unread_tokens", "output_tokens", "blocks", "language"}
    assert writes_of_fields(source, fields) == [
        (1, "pending_tokens"),
        (2, "unread_tokens"),
        (4, "blocks"),
        (5, "language"),
        (3, "output_tokens"),
    ]


def test_a_requests_state_is_written_only_by_the_scheduler_and_its_own_methods():
    fields = request_fields()
    assert {"pending_tokens", "unread_tokens", "output_tokens", "submitted_s"} <= fields
    writes = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {field}"
        for path in module_files().values()
        if str(path.relative_to(REPO_ROOT)).startswith("engine/")
        and not str(path.relative_to(REPO_ROOT)).startswith(REQUEST_WRITERS)
        for line, field in writes_of_fields(path.read_text(), fields)
    ]
    assert not writes, "a request's fields written outside the scheduler:\n" + "\n".join(writes)
