"""The packages point one way, and this test holds them to it (every import, at the top of a module
or inside a function):

- `kernels/` imports nothing of the project but `kernels` itself;
- nothing imports `launch/` but `launch/` and the tests;
- `distengine/` reaches `workers/` only through its executor;
- `workers/` takes from `distengine/` only the shared contract: the engine config, the step types,
  what a worker reports, the KV cache plan and specs, the model description and its quantization.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("distengine", "workers", "kernels", "launch")
CONTRACT = {"distengine.config", "distengine.step", "distengine.worker_info", "distengine.kv_cache.plan",
            "distengine.quantization", "distengine.kv_cache.specs", "distengine.model_config",
            "distengine.hf_config", "distengine.config_snapshot"}
EXECUTOR = "distengine.executor"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: pathlib.Path, root: pathlib.Path) -> set[str]:
    """Every module a file imports (a `from X import y` counts as X, and as X.y when that is a
    module of the project)."""
    tree = ast.parse(path.read_text(), str(path))
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base:
                found.add(base)
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                where = root / sub.replace(".", "/")
                if where.with_suffix(".py").exists() or where.is_dir():
                    found.add(sub)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def violations(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(p for folder in (*PACKAGES, "examples") for p in (root / folder).rglob("*.py")):
        name = module_name(path, root)
        top = name.split(".")[0]
        for mod in sorted(imports(path, root)):
            target = mod.split(".")[0]
            if top == "kernels" and target != "kernels":
                bad.append(f"{name} imports {mod}: kernels import nothing of the project")
            if target == "launch" and top != "launch":
                bad.append(f"{name} imports {mod}: only launch and the tests import launch")
            if top == "distengine" and target == "workers" and name != EXECUTOR:
                bad.append(f"{name} imports {mod}: distengine reaches workers only through {EXECUTOR}")
            if top == "workers" and target == "distengine" and mod not in CONTRACT:
                bad.append(f"{name} imports {mod}: workers take only the contract from distengine "
                           f"({', '.join(sorted(CONTRACT))})")
    return bad


def test_packages_point_one_way():
    assert violations() == []


def test_the_rules_catch_wrong_imports(tmp_path):
    """Imports inside functions and relative ones count too: a test that cannot fail holds nothing."""
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "workers" / "w.py").write_text("def f():\n    from distengine.scheduler import Scheduler\n"
                                               "    from .. import launch\n")
    (tmp_path / "kernels" / "k.py").write_text("import workers.w\n")
    (tmp_path / "distengine" / "d.py").write_text("from workers import w\n")
    (tmp_path / "distengine" / "executor.py").write_text("from workers import w\nfrom distengine import d\n")
    found = violations(tmp_path)
    assert found == ["distengine.d imports workers: distengine reaches workers only through distengine.executor",
                     "distengine.d imports workers.w: distengine reaches workers only through distengine.executor",
                     "kernels.k imports workers.w: kernels import nothing of the project",
                     "workers.w imports distengine.scheduler: workers take only the contract from distengine "
                     f"({', '.join(sorted(CONTRACT))})",
                     "workers.w imports launch: only launch and the tests import launch"], found
