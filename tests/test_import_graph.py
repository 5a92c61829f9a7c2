"""The import graph of the whole pyllm package: no cycles, and data flows one way (file -> tensors -> model ->
runtime -> CLI/server).

Reference: the graph is built from the source text with ``ast`` (nothing is imported), counting every import
statement wherever it stands (inside functions too: an import deferred into a function body is still a cycle,
only hidden), with relative imports resolved against the importing module's package. ``from P import x`` is an
edge to the module ``P.x`` when that file exists, else to ``P``. Imports under ``if TYPE_CHECKING:`` are left out
(they never run). Importing ``P.x`` also runs ``P/__init__.py``; that implicit edge is not counted, since Python
finishes a package's ``__init__`` before it imports the package's modules, so it cannot close a cycle.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "pyllm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside ``if TYPE_CHECKING:`` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    skip.update(id(n) for n in ast.walk(sub))
    return skip


def build_graph() -> tuple[dict[str, Path], dict[str, dict[str, list[str]]]]:
    """({module: file}, {module: {imported module: ["file:line", ...]}}) for every module of pyllm."""
    files = {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in files}

    def target(base: str, name: str | None) -> str | None:
        full = f"{base}.{name}" if name else base
        if full in files:
            return full
        return base if base in files else None

    for mod, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        skip = _type_checking_nodes(tree)
        pkg = package_of(mod, path)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            found: list[str | None] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "pyllm" or alias.name.startswith("pyllm."):
                        # `import pyllm.a.b` binds pyllm but runs pyllm.a.b: the deepest module is the edge
                        found.append(target(alias.name, None) or target(alias.name.rpartition(".")[0], None))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = pkg.split(".")
                    base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                    base = ".".join(base_parts + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                    if base != "pyllm" and not base.startswith("pyllm."):
                        continue
                found.extend(target(base, alias.name) for alias in node.names)
            for t in found:
                if t is not None and t != mod:
                    where = f"{path.relative_to(PACKAGE_DIR.parent)}:{node.lineno}"
                    sites = graph[mod].setdefault(t, [])
                    if where not in sites:
                        sites.append(where)
    return files, graph


def strongly_connected(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Tarjan's components with more than one module (iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def shortest_path(graph, start: str, goal: str, within: set[str] | None = None) -> list[str] | None:
    prev = {start: None}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        if node == goal:
            path = []
            while node is not None:
                path.append(node)
                node = prev[node]
            return path[::-1]
        for nxt in graph[node]:
            if nxt not in prev and (within is None or nxt in within):
                prev[nxt] = node
                queue.append(nxt)
    return None


def describe_path(graph, path: list[str]) -> str:
    steps = [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in zip(path, path[1:])]
    return "\n      ".join(steps)


def find_cycles(graph) -> tuple[list[str], list[str]]:
    """(cycles, imports on them): for every import that lies on a cycle, the shortest cycle through it, each
    cycle once as 'a -> b -> ... -> a'; and each of those imports once with its file and line."""
    cycles: set[tuple[str, ...]] = set()
    edges: set[tuple[str, str]] = set()
    for comp in strongly_connected(graph):
        members = set(comp)
        for a in comp:
            for b in graph[a]:
                if b not in members:
                    continue
                ring = [a] + shortest_path(graph, b, a, members)
                edges.update(zip(ring, ring[1:]))
                nodes = ring[:-1]
                k = nodes.index(min(nodes))
                cycles.add(tuple(nodes[k:] + nodes[:k]))
    return ([" -> ".join(c + (c[0],)) for c in sorted(cycles)],
            [f"{a} -> {b} ({', '.join(graph[a][b])})" for a, b in sorted(edges)])


def test_graph_sees_hidden_and_relative_imports():
    """The builder itself: a function-level relative import (pyllm/__init__.py's lazy `from . import llm`) is an
    edge, and `from .. import registry` in pyllm/cli/main.py resolves to the module pyllm.registry."""
    files, graph = build_graph()
    assert "pyllm.llm" in graph["pyllm"]
    assert "pyllm.registry" in graph["pyllm.cli.main"]
    assert "pyllm.cli.main" in graph["pyllm.__main__"]


def test_no_import_cycles():
    _, graph = build_graph()
    cycles, imports = find_cycles(graph)
    assert not cycles, (f"{len(cycles)} import cycle(s) in pyllm:\n  " + "\n  ".join(cycles)
                        + "\nthrough these imports:\n  " + "\n  ".join(imports))


def _reach(graph, sources: list[str], forbidden) -> list[str]:
    bad = []
    for src in sources:
        for dst in graph:
            if forbidden(dst) and dst != src:
                path = shortest_path(graph, src, dst)
                if path:
                    bad.append(f"{src} reaches {dst}:\n      " + describe_path(graph, path))
    return bad


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_library_layers_never_import_the_cli_or_the_server():
    """Nothing under pyllm/models, pyllm/runtime or pyllm/backends imports pyllm/cli or pyllm/server, directly
    or through another module."""
    _, graph = build_graph()
    sources = [m for m in graph if _under(m, "pyllm.models", "pyllm.runtime", "pyllm.backends")]
    bad = _reach(graph, sources, lambda m: _under(m, "pyllm.cli", "pyllm.server"))
    assert not bad, "\n  ".join(["layering broken:"] + bad)


def test_file_readers_do_not_import_the_llm():
    """The GGUF and AWQ readers produce values that pyllm/llm.py turns into an LLM; they never import it back
    (directly, or through `import pyllm`, whose lazy `load` is pyllm/llm.py)."""
    _, graph = build_graph()
    sources = [m for m in graph if m == "pyllm.formats.gguf" or _under(m, "pyllm.formats.awq", "pyllm.formats")]
    assert "pyllm.formats.gguf" in sources and "pyllm.formats.awq.folder" in sources
    bad = _reach(graph, sources, lambda m: m == "pyllm.llm")
    assert not bad, "\n  ".join(["a reader imports the LLM:"] + bad)


def test_cli_modules_share_only_the_common_module():
    """Inside pyllm/cli the shared helpers live in pyllm/cli/common.py; main dispatches to the subcommand modules;
    no other cli module imports another one (so none ever imports main)."""
    _, graph = build_graph()
    bad = []
    for mod, deps in graph.items():
        if not _under(mod, "pyllm.cli") or mod == "pyllm.cli.main":
            continue
        for dep, where in deps.items():
            if _under(dep, "pyllm.cli") and dep != "pyllm.cli.common":
                bad.append(f"{mod} -> {dep} ({', '.join(where)})")
    assert "pyllm.cli.common" in graph
    assert not bad, "cli modules importing each other:\n  " + "\n  ".join(bad)


def test_cli_help_does_not_import_torch():
    # `pyllm --help` and usage errors answer in a fraction of a second: the parser of every subcommand is built
    # without torch (several seconds of import), which only the commands that run a model load.
    import subprocess
    import sys

    code = ("import sys\nfrom pyllm.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_reading_a_gguf_header_pull_info_and_list_do_not_import_torch(smollm2_path):
    # `pyllm pull` of a cached model, `pyllm info` (the header, the architecture's spec, KV sizes of a --kv kind) and
    # `pyllm list` answer without torch; only a tensor's data view (GGUFFile.raw) imports it.  Reference:
    # sys.modules of a fresh interpreter.
    import os
    import subprocess
    import sys

    code = ("import sys\nfrom pyllm.formats.gguf import open_gguf\nfrom pyllm.cli.main import main\n"
            f"gf = open_gguf({smollm2_path!r})\nassert gf.metadata and gf.tensors\n"
            "assert main(['pull', 'smollm2-135m']) == 0\n"
            f"assert main(['info', {smollm2_path!r}, '--ctx', '512', '--kv', 'f16/q8_0', '--json']) == 0\n"
            "assert main(['list']) == 0\nprint('torch' in sys.modules)\n"
            "gf.raw(next(iter(gf.tensors)))\nprint('torch' in sys.modules)")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-2:] == ["False", "True"], out.stdout
