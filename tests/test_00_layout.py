"""Where code goes (CONTRIBUTING.md, "Where code goes: one rule"), checked on the source.

- no import cycle anywhere in ``course/`` or ``autograder/``, function-level imports included;
- imports go one way: ``course.kit`` <- ``course.<pattern>`` <- ``course.chapters.chNN`` <-
  ``autograder.checks.chNN``; nothing in ``course/`` imports ``autograder``;
- no module over 700 lines, and no pattern that imports matplotlib when it is imported;
- every table, view, sequence, SQL function, procedure and trigger is created by one module.

Everything is read statically (the AST of each file, the SQL in its string literals):
nothing is imported or run. Each scanner is a small function, and each is also run on
made-up input that breaks its rule, so a check that could never fail would show here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("course", "autograder")
MAX_LINES = 700


# ----------------------------------------------------------------------------- reading the tree


def module_name(path: Path, root: Path) -> str:
    """``course/chapters/ch04/__init__.py`` -> ``course.chapters.ch04``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_tree(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, tuple[Path, str]]:
    """{module name: (path, source)} for every ``.py`` file of ``packages`` under ``root``."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "__pycache__" not in path.parts:
                modules[module_name(path, root)] = (path, path.read_text(encoding="utf-8"))
    return modules


def imported_modules(name: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The modules of ``known`` that ``name`` imports, anywhere in its source (functions too).

    ``from pkg import x`` counts as importing ``pkg.x`` when that is a module, else ``pkg``.
    Relative imports are resolved against ``name`` (a package resolves against itself).
    """
    found = set()
    base = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                origin = ".".join([*anchor, *([origin] if origin else [])])
            targets = [
                f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in known:  # import a.b.c of a module we do not know: its package
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(modules: dict[str, tuple[Path, str]]) -> dict[str, set[str]]:
    known = set(modules)
    return {
        name: imported_modules(name, source, known, is_package=path.name == "__init__.py")
        for name, (path, source) in modules.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or around a loop (Tarjan's SCCs)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# ----------------------------------------------------------------------------- which way imports go


def layer(module: str) -> tuple[str, str | None]:
    """("kit" | "pattern" | "chapter" | "check" | "grader" | "root", chapter number or None)."""
    parts = module.split(".")
    if parts[0] == "autograder":
        if len(parts) >= 3 and parts[1] == "checks" and re.fullmatch(r"ch\d\d", parts[2]):
            return "check", parts[2][2:]
        return "grader", None
    if len(parts) == 1:
        return "root", None  # course/__init__.py: course.grading()
    if parts[1] == "kit":
        return "kit", None
    if parts[1] == "chapters":
        if len(parts) >= 3 and re.fullmatch(r"ch\d\d", parts[2]):
            return "chapter", parts[2][2:]
        return "root", None  # course/chapters/__init__.py
    return "pattern", None


def wrong_way(importer: str, imported: str) -> str | None:
    """Why ``importer`` must not import ``imported``, or None when the import goes the right way."""
    (kind, chapter), (target, target_chapter) = layer(importer), layer(imported)
    if importer.startswith("course") and imported.startswith("autograder"):
        return "nothing in course/ imports the grader"
    if kind == "kit" and target in ("pattern", "chapter"):
        return "the toolkit imports no pattern and no chapter"
    if kind == "pattern" and target == "chapter":
        return "a pattern imports no chapter's demos"
    if kind == "chapter" and target == "chapter" and chapter != target_chapter:
        return "a chapter imports no other chapter's demos (reuse the pattern instead)"
    if kind in ("check", "grader") and target == "chapter" and chapter != target_chapter:
        return "only chapter NN's checks import chapter NN's demos"
    return None


def wrong_way_imports(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{importer} imports {imported}: {why}"
        for importer, targets in sorted(graph.items())
        for imported in sorted(targets)
        if (why := wrong_way(importer, imported))
    ]


# ----------------------------------------------------------------------------- patterns stay light


def plots_at_import(source: str) -> bool:
    """Does the module import matplotlib at module level (not inside a function)?"""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "matplotlib" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "matplotlib":
            return True
    return False


# ----------------------------------------------------------------------------- size


def too_long(modules: dict[str, tuple[Path, str]], limit: int = MAX_LINES) -> list[str]:
    return [
        f"{name}: {len(source.splitlines())} lines"
        for name, (_, source) in sorted(modules.items())
        if len(source.splitlines()) > limit
    ]


# ----------------------------------------------------------------------------- who creates which table

_NAME = r'(?:"[^"]+"|[A-Za-z_][A-Za-z0-9_$]*)'
CREATE = re.compile(
    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(?:(?:GLOBAL|LOCAL)\s+)?(?:(?:TEMPORARY|TEMP|UNLOGGED)\s+)?(?:RECURSIVE\s+)?"
    r"(?P<kind>TABLE|MATERIALIZED\s+VIEW|VIEW|FUNCTION|PROCEDURE|SEQUENCE|TRIGGER)\s+(?:IF\s+NOT\s+EXISTS\s+)?"
    rf"(?P<name>{_NAME}(?:\.{_NAME})?)",
    re.IGNORECASE,
)
#: PostgreSQL keeps tables, views and sequences in one namespace, functions and procedures in another.
NAMESPACE = {
    "table": "relation",
    "view": "relation",
    "materialized view": "relation",
    "sequence": "relation",
    "function": "routine",
    "procedure": "routine",
    "trigger": "trigger",
}


def _normalized(name: str) -> str:
    parts = [p[1:-1] if p.startswith('"') else p.lower() for p in re.findall(_NAME, name)]
    if len(parts) == 2 and parts[0] == "public":
        parts = parts[1:]
    return ".".join(parts)


def created_objects(source: str) -> set[tuple[str, str]]:
    """``(namespace, name)`` of everything a module's string literals CREATE."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for m in CREATE.finditer(node.value):
                kind = " ".join(m.group("kind").lower().split())
                found.add((NAMESPACE[kind], _normalized(m.group("name"))))
    return found


def owners(sources: dict[str, str]) -> dict[tuple[str, str], list[str]]:
    """Every created object and the modules that create it."""
    made: dict[tuple[str, str], list[str]] = {}
    for module, source in sorted(sources.items()):
        for obj in created_objects(source):
            made.setdefault(obj, []).append(module)
    return made


def created_twice(sources: dict[str, str]) -> list[str]:
    return [
        f"{namespace} {name} is created by {', '.join(modules)}"
        for (namespace, name), modules in sorted(owners(sources).items())
        if len(modules) > 1
    ]


# ----------------------------------------------------------------------------- the real tree


@pytest.fixture(scope="module")
def tree():
    return read_tree(REPO)


@pytest.fixture(scope="module")
def graph(tree):
    return import_graph(tree)


def test_the_scan_sees_the_whole_tree(tree, graph):
    assert {"course.kit.lab", "course.caching", "course.chapters.ch04", "autograder.checks.ch03"} <= set(tree)
    assert "course.caching" in graph["course.chapters.ch04"]
    assert "course.chapters.ch04" in graph["autograder.checks.ch04"]
    assert "course.kit.notebook" in graph["course.kit.lab"]  # imported inside a function


def test_no_import_cycle_in_course_or_autograder(graph):
    found = cycles(graph)
    assert not found, "modules that import each other:\n" + "\n".join(", ".join(group) for group in found)


def test_imports_go_one_way(graph):
    found = wrong_way_imports(graph)
    assert not found, "imports against the direction:\n" + "\n".join(found)


def test_no_pattern_imports_matplotlib_at_import(tree):
    found = [name for name, (_, source) in tree.items() if layer(name)[0] == "pattern" and plots_at_import(source)]
    assert not found, f"patterns that import matplotlib at module level (plot in course/chapters): {found}"


def test_no_module_is_over_700_lines(tree):
    found = too_long(tree)
    assert not found, f"over {MAX_LINES} lines (split the module):\n" + "\n".join(found)


def test_every_table_view_and_sql_function_has_one_owner(tree):
    found = created_twice({name: source for name, (_, source) in tree.items()})
    assert not found, "one owner per object; the others call its setup function:\n" + "\n".join(found)


def test_the_chapters_tables_have_the_owners_contributing_names(tree):
    made = owners({name: source for name, (_, source) in tree.items()})
    assert made[("relation", "idempotency_keys")] == ["course.idempotency"]
    assert made[("relation", "orders")] == ["course.idempotency"]
    assert made[("relation", "ch04_orders")] == ["course.chapters.ch04"]
    assert made[("relation", "source_loads")] == ["autograder.checks.ch04"]


# ----------------------------------------------------------------------------- the scanners fail when they should


def _fake_tree(tmp_path: Path, files: dict[str, str]) -> dict[str, tuple[Path, str]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return read_tree(tmp_path)


def test_a_made_up_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    fake = _fake_tree(
        tmp_path,
        {
            "course/__init__.py": "",
            "course/kit/__init__.py": "",
            "course/kit/backends.py": "def stop():\n    from course.kit import lab\n    lab.shutdown()\n",
            "course/kit/lab.py": "from course.kit.backends import stop\n",
        },
    )
    assert cycles(import_graph(fake)) == [["course.kit.backends", "course.kit.lab"]]


def test_relative_imports_are_resolved(tmp_path):
    fake = _fake_tree(
        tmp_path,
        {
            "autograder/__init__.py": "",
            "autograder/checks/__init__.py": "",
            "autograder/checks/ch09/__init__.py": "from .versions import ALL\nfrom ..ch08 import X\n",
            "autograder/checks/ch09/versions.py": "from . import ALL\n",
            "autograder/checks/ch08.py": "X = 1\n",
        },
    )
    graph = import_graph(fake)
    assert graph["autograder.checks.ch09"] == {"autograder.checks.ch09.versions", "autograder.checks.ch08"}
    assert cycles(graph) == [["autograder.checks.ch09", "autograder.checks.ch09.versions"]]


def test_imports_against_the_direction_are_named(tmp_path):
    fake = _fake_tree(
        tmp_path,
        {
            "course/__init__.py": "",
            "course/kit/__init__.py": "",
            "course/kit/faults.py": "from course.caching import CacheAside\n",
            "course/caching.py": "def demo():\n    from course.chapters.ch04 import stampede\n",
            "course/chapters/__init__.py": "",
            "course/chapters/ch03.py": "from course.chapters import ch04\nfrom course import caching\n",
            "course/chapters/ch04/__init__.py": "from course.kit import faults\nfrom course import caching\n",
            "course/chapters/ch04/processes.py": "from course.chapters.ch04 import stampede\n",
            "course/payments.py": "import autograder.harness\n",
            "autograder/__init__.py": "",
            "autograder/harness.py": "",
            "autograder/checks/__init__.py": "",
            "autograder/checks/ch03.py": "from course.chapters.ch04 import setup_users\nfrom course.chapters import ch03\n",
            "autograder/checks/ch04.py": "from course.chapters.ch04 import processes\n",
        },
    )
    assert wrong_way_imports(import_graph(fake)) == [
        "autograder.checks.ch03 imports course.chapters.ch04: only chapter NN's checks import chapter NN's demos",
        "course.caching imports course.chapters.ch04: a pattern imports no chapter's demos",
        "course.chapters.ch03 imports course.chapters.ch04: a chapter imports no other chapter's demos"
        " (reuse the pattern instead)",
        "course.kit.faults imports course.caching: the toolkit imports no pattern and no chapter",
        "course.payments imports autograder.harness: nothing in course/ imports the grader",
    ]


def test_a_pattern_that_plots_at_import_is_found():
    assert plots_at_import("import matplotlib.pyplot as plt\n")
    assert plots_at_import("from matplotlib import pyplot\n")
    assert not plots_at_import("def plot():\n    import matplotlib.pyplot as plt\n")


def test_a_long_module_is_named(tmp_path):
    fake = _fake_tree(tmp_path, {"course/__init__.py": "", "course/big.py": "x = 1\n" * (MAX_LINES + 1)})
    assert too_long(fake) == [f"course.big: {MAX_LINES + 1} lines"]


@pytest.mark.parametrize(
    ("sql", "expected"),
    [
        ("CREATE TABLE IF NOT EXISTS orders (id int)", ("relation", "orders")),
        ("create table Orders (id int)", ("relation", "orders")),
        ("CREATE UNLOGGED TABLE hits (n int)", ("relation", "hits")),
        ("CREATE TEMP TABLE scratch (n int)", ("relation", "scratch")),
        ("CREATE TEMPORARY TABLE IF NOT EXISTS scratch2 (n int)", ("relation", "scratch2")),
        ("CREATE OR REPLACE VIEW users AS SELECT 1", ("relation", "users")),
        ("CREATE MATERIALIZED VIEW IF NOT EXISTS totals AS SELECT 1", ("relation", "totals")),
        ("CREATE SEQUENCE IF NOT EXISTS crash_seq", ("relation", "crash_seq")),
        ("CREATE OR REPLACE FUNCTION slow_product(p_id bigint) RETURNS int", ("routine", "slow_product")),
        ("CREATE PROCEDURE tidy()", ("routine", "tidy")),
        ("CREATE TRIGGER crash_credit BEFORE UPDATE ON accounts", ("trigger", "crash_credit")),
        ('CREATE TABLE "Mixed Case" (n int)', ("relation", "Mixed Case")),
        ("CREATE TABLE public.ledger (n int)", ("relation", "ledger")),
        ("CREATE TABLE audit.ledger (n int)", ("relation", "audit.ledger")),
    ],
)
def test_every_create_form_is_recognised(sql, expected):
    assert created_objects(f"SQL = {sql!r}\n") == {expected}


def test_a_table_created_by_two_made_up_modules_is_named():
    sources = {
        "course.fake_a": 'SCHEMA = """\nCREATE TABLE IF NOT EXISTS orders (id bigint);\n"""\n',
        "course.fake_b": "def setup(conn):\n    conn.execute('CREATE UNLOGGED TABLE orders (id text)')\n",
        "course.fake_c": "V = 'CREATE OR REPLACE VIEW totals AS SELECT 1'\n",
        "course.fake_d": "T = 'CREATE TABLE totals (n int)'  # a view and a table share one namespace\n",
        "course.fake_e": "F = 'CREATE FUNCTION orders() RETURNS int'  # functions have a namespace of their own\n",
    }
    assert created_twice(sources) == [
        "relation orders is created by course.fake_a, course.fake_b",
        "relation totals is created by course.fake_c, course.fake_d",
    ]


def test_a_mention_of_create_in_prose_is_not_a_creation():
    assert created_objects('"""The module that creates a table (`CREATE TABLE`, `VIEW`) owns it."""\n') == set()
