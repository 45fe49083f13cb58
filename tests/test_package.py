"""The package's shape: files and classes small enough to read in one sitting.

The import direction between layers is checked by ``lint-imports`` (the
contracts in pyproject.toml), which .ci/run runs before the tests.
"""

import ast
from pathlib import Path

import mlx_paged

PACKAGE = Path(mlx_paged.__file__).parent
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250


def sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_file_is_too_long():
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_class_is_too_long():
    long = {}
    for p in sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    long[f"{p.relative_to(PACKAGE)}:{node.name}"] = n
    assert not long, f"classes over {MAX_CLASS_LINES} lines: {long}"
