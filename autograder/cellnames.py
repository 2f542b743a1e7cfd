"""Which names a notebook cell defines and which it uses (from its syntax, never by running it).

Grading runs only a chapter's setup, answer and test cells (see :mod:`autograder.grading`),
so those cells must not lean on a name that only a demo cell defines, and a demo cell must
not redefine a name they use: ``tests/test_00_notebooks.py`` checks both with these helpers.
"""

from __future__ import annotations

import ast
import builtins
import re

_MAGIC = re.compile(r"^\s*[%!].*$", re.MULTILINE)


def parse(source: str) -> ast.Module:
    """The cell's syntax tree; IPython magics and shell lines are blanked out first."""
    return ast.parse(_MAGIC.sub("", source))


def bindings(source: str) -> dict[str, str]:
    """Names a cell binds at its top level, each with where it comes from.

    An import binds ``"import course.breaker.CircuitOpenError"``; anything else (an
    assignment, a ``def``, a loop variable, ``with ... as``) binds ``"cell"``. Two cells that
    import the same thing from the same place bind the same object.
    """
    names: dict[str, str] = {}
    for node in _top_level(parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = "cell"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = (
                    f"import {alias.name if alias.asname else alias.name.split('.')[0]}"
                )
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = f"import {node.module}.{alias.name}"
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names[node.id] = "cell"
    return names


def defined(source: str) -> set[str]:
    """Names a cell binds at its top level (assignments, imports, defs, loops, ``with ... as``)."""
    return set(bindings(source))


def _top_level(tree: ast.Module):
    """Every node of the module that is not inside a function, lambda or class body."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue  # their bodies bind local names; their own name was yielded above
        stack.extend(ast.iter_child_nodes(node))


def used(source: str) -> set[str]:
    """Global names a cell reads, at its top level or from inside its functions."""
    tree = parse(source)
    loads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    local: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    local.add(a.arg)
            if not isinstance(node, ast.Lambda):
                for inner in ast.walk(node):
                    if isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                        local.add(inner.id)
                    elif inner is not node and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        local.add(inner.name)
                    elif isinstance(inner, (ast.Import, ast.ImportFrom)):
                        local.update((a.asname or a.name).split(".")[0] for a in inner.names)
        elif isinstance(node, ast.comprehension):
            for inner in ast.walk(node.target):
                if isinstance(inner, ast.Name):
                    local.add(inner.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            local.add(node.name)
    return loads - (local - defined(source)) - set(dir(builtins))
