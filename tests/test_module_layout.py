"""Layout rules read from the source: no private names across modules of kernels/, no import cycles,
engine/ free of ray and opentelemetry, benchmarks/ independent of tests/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "actors", "kernels", "observability", "benchmarks")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, imported names) of every import in the file, function-level ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [alias.name for alias in node.names]))
    return out


def _sources(*packages: str) -> dict[str, Path]:
    return {_module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


def test_no_kernel_module_imports_another_modules_private_names():
    offenders = [(name, mod, n) for name, path in _sources("kernels").items() for mod, names in _imports(path)
                 if mod.startswith("kernels") and mod != name for n in names if n.startswith("_")]
    assert offenders == []


def test_kernel_twins_share_checks_instead_of_importing_each_other():
    for ref, twin in [("routing", "routing_triton"), ("rejection", "rejection_triton"),
                      ("expert_ffn", "expert_ffn_triton")]:
        twin_imports = {mod for mod, _ in _imports(ROOT / "kernels" / f"{twin}.py")}
        assert f"kernels.{ref}" not in twin_imports, twin
        assert "kernels.checks" in twin_imports, twin
        assert "kernels.checks" in {mod for mod, _ in _imports(ROOT / "kernels" / f"{ref}.py")}, ref


def test_no_import_cycles_between_project_modules():
    sources = _sources(*PACKAGES)
    graph = {name: {mod for mod, names in _imports(path) for mod in [mod, *(f"{mod}.{n}" for n in names)]
                    if mod in sources and mod != name} for name, path in sources.items()}
    # Package __init__ re-exports are not cycles of logic: only module -> module edges count.
    graph = {n: {m for m in deps if not sources[m].name == "__init__.py"} for n, deps in graph.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_engine_imports_neither_ray_nor_opentelemetry():
    bad = [(name, mod) for name, path in _sources("engine").items() for mod, _ in _imports(path)
           if mod.split(".")[0] in ("ray", "opentelemetry", "actors", "observability")]
    assert bad == []


def test_benchmarks_do_not_import_tests():
    bad = [(name, mod) for name, path in _sources("benchmarks").items() for mod, _ in _imports(path)
           if mod.split(".")[0] == "tests"]
    assert bad == []
