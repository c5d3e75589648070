"""The suite's layout: no test module (nor a conftest) is imported by another module.

Shared helpers live in tests/support/; a test module that another one imports runs its
fixtures and module-level code twice, and couples tests that should stand alone. Read from the
AST, function-level imports included.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def is_test_module(name: str) -> bool:
    """`tests.….test_x` or `tests.….conftest` (a dotted module name)."""
    parts = name.split(".")
    return parts[0] == "tests" and (parts[-1].startswith("test_") or parts[-1] == "conftest")


def imported(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement names, with its line: `import a.b` names a.b, and
    `from a import b` names both a and a.b (b may be a module)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def offences(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, name in sorted(imported(ast.parse(path.read_text(), str(path)))):
            if is_test_module(name):
                found.append(f"{path.relative_to(root.parent)}:{line} imports {name}")
    return found


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    assert offences(TESTS) == [], "move what is shared to tests/support/"


def test_the_check_sees_every_kind_of_import(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "support").mkdir(parents=True)
    (tests / "test_a.py").write_text(
        "from tests.support.waiting import until\n"
        "def f():\n"
        "    from tests.test_b import X\n"
        "import tests.mesh.conftest\n"
        "from tests.mesh import test_c\n"
    )
    assert offences(tests) == [
        "tests/test_a.py:3 imports tests.test_b",
        "tests/test_a.py:4 imports tests.mesh.conftest",
        "tests/test_a.py:5 imports tests.mesh.test_c",
    ]
