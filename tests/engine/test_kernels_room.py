"""The kernels room: the fast path's plumbing (C++ sources, their loader, the linear backends and
their tuning, the FastPath holder) lives in workers/kernels/, the model in workers/model/, and
the model reaches the plumbing only through workers.kernels. One loader builds every C++ module.
The decode program and the LM that runs it do not import each other back.

The import graph is read from the sources with `ast`: every import statement, including those
inside functions and under `if TYPE_CHECKING:`, counts."""

from __future__ import annotations

import ast
from pathlib import Path

from workers.kernels import cpp_build, extensions

ROOT = Path(__file__).resolve().parents[2]
MODEL, KERNELS = ROOT / "workers" / "model", ROOT / "workers" / "kernels"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports_of(path: Path) -> set[str]:
    """The modules `path` imports: `from a.b import c` counts as a.b.c when that is a module."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if exists(f"{base}.{alias.name}"))
    return found


def graph(only_existing: bool = True) -> dict[str, set[str]]:
    """workers' own modules -> the workers modules each imports (with `only_existing=False`, also
    the names of modules that do not exist)."""
    edges = {module_name(p): imports_of(p) for p in sorted((ROOT / "workers").rglob("*.py"))}
    keep = (lambda i: i in edges) if only_existing else (lambda i: i.startswith("workers."))
    return {m: {i for i in found if keep(i)} for m, found in edges.items()}


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module == goal:
            return True
        if module not in seen:
            seen.add(module)
            todo.extend(edges.get(module, ()))
    return False


def test_the_scan_finds_the_imports_it_checks():
    edges = graph()
    assert "workers.model.decode_program" in edges["workers.model.hybrid_lm"]
    assert "workers.kernels.fast_path" in edges["workers.model.layers"]
    assert "workers.kernels.extensions" in edges["workers.runner"]


def test_the_model_reaches_the_plumbing_only_through_workers_kernels():
    """No module of workers/model/ imports a kernel-plumbing name from anywhere but workers.kernels
    (an old path would fail at import anyway; a copy of a module back in workers/model/ would not),
    and the kernels room does not import the model back."""
    plumbing = {p.stem for p in KERNELS.glob("*.py") if p.stem != "__init__"}
    plumbing |= {"kernels", "scan_kernels", "panel_gemm"}  # the loaders extensions.py replaced
    assert {"cpp_build", "extensions", "fast_path", "linear_backends", "linear_tuning", "huge_pages"} <= plumbing
    assert not plumbing & {p.stem for p in MODEL.glob("*.py")}, "a plumbing module is back in workers/model/"
    assert not list(MODEL.rglob("*.cpp")) and not list(MODEL.rglob("*.h"))
    edges = graph(only_existing=False)
    for module, found in edges.items():
        if module.startswith("workers.model"):
            wrong = {i for i in found if i.rpartition(".")[2] in plumbing and not i.startswith("workers.kernels.")}
            assert not wrong, f"{module} imports {wrong}"
        if module.startswith("workers.kernels"):
            assert not {i for i in found if i.startswith("workers.model")}, f"{module} imports the model"


def test_one_loader_builds_every_kernel_source():
    """Only extensions.py declares C++ modules, and every source in csrc/ is built by one of them."""
    declaring = set()
    for path in sorted((ROOT / "workers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "CpuExtension":
                declaring.add(module_name(path))
    assert declaring == {"workers.kernels.extensions"}
    modules = [v for v in vars(extensions).values() if isinstance(v, cpp_build.CpuExtension)]
    assert {m.name for m in modules} == {"hybridserve_decode_kernels", "hybridserve_ssd_scan", "hybridserve_panel_gemm"}
    sources = [s for m in modules for s in m.sources]
    assert sorted(sources) == sorted(extensions.CSRC.glob("*.cpp")), "a source built twice, or never"


def test_the_decode_program_does_not_import_the_lm_back():
    edges = graph()
    lm, program = "workers.model.hybrid_lm", "workers.model.decode_program"
    assert reaches(edges, lm, program)
    assert not reaches(edges, program, lm)
