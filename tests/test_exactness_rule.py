"""The exactness rule (flowmesh/testing.py, the README's "Exactness") stays enforced: every
bit-exact comparison in the tests and the demo is a documented case of pure data movement."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = [*sorted((ROOT / "tests").rglob("*.py")), ROOT / "client_sdk" / "demo.py"]

# Whole files whose tensor comparisons are all pure data movement.
ALLOWED_FILES = {
    "tests/test_protocol.py": "protocol round trips: tensors encoded to frames and decoded back",
}

# Calls that compare bits, or tolerances chosen by hand (which is how a forward gets compared
# "exactly enough" without saying so): forward outputs go through assert_forward_close instead.
BIT_EXACT = {"equal", "allclose", "assert_same_bits"}
MARKER = re.compile(r"#\s*bit-exact:\s*\S")


def exact_calls(tree: ast.AST) -> list[ast.Call]:
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if name in BIT_EXACT:
                calls.append(node)
    return calls


def marked(lines: list[str], call: ast.Call) -> bool:
    """The marker sits on a line of the call, or on a comment line just above it."""
    first, last = call.lineno, call.end_lineno or call.lineno
    span = lines[first - 1 : last]
    above = lines[first - 2] if first >= 2 else ""
    if above.lstrip().startswith("#"):
        span.append(above)
    return any(MARKER.search(line) for line in span)


def unmarked(source: str, name: str) -> list[str]:
    lines = source.splitlines()
    return [
        f"{name}:{c.lineno}: {lines[c.lineno - 1].strip()}"
        for c in sorted(exact_calls(ast.parse(source, name)), key=lambda c: c.lineno)
        if not marked(lines, c)
    ]


def violations(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    return [] if rel in ALLOWED_FILES else unmarked(path.read_text(), rel)


def test_bit_exact_comparisons_are_documented_data_movement() -> None:
    bad = [v for path in SCANNED for v in violations(path)]
    assert not bad, (
        "bit-exact comparison without '# bit-exact: <which data movement>' (see "
        "flowmesh/testing.py): compare forward outputs with "
        "flowmesh.testing.assert_forward_close instead:\n" + "\n".join(bad)
    )


def test_the_scan_sees_what_it_must() -> None:
    # The scan itself can fail: unmarked comparisons are found, a marker without a reason does
    # not count, and a marker covers only its own call.
    probe = (
        "import torch\n"
        "assert torch.equal(a, b)\n"
        "assert torch.allclose(a, b, rtol=1e-4)\n"
        "assert y.equal(z)  # bit-exact:\n"
        "assert torch.equal(w, v)  # bit-exact: host tier copy\n"
        "assert torch.equal(s, t)\n"
        "# bit-exact: weights read from the file\n"
        "assert_same_bits(\n    p,\n    q,  # (any line of the call may carry it)\n)\n"
    )
    found = [int(v.split(":")[1]) for v in unmarked(probe, "probe.py")]
    assert found == [2, 3, 4, 6]
