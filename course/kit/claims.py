"""A claim beside what this run measured, and whether the run bore it out.

A sentence written once in a chapter's prose stays the same when the machine is slower; the
measurement above it does not. So a chapter states what it expects as a *claim* and lets the
run say whether it held::

    from course.kit.claims import check

    check(
        "full jitter makes fewer than half the calls of plain exponential backoff",
        measured=f"{jitter:.0f} calls against {plain:.0f}",
        held=jitter < plain / 2,
        source="Brooker 2015, AWS Architecture Blog",
        otherwise="few clients: with under 20 the herd is too small to collide much",
    )

prints::

    [held] full jitter makes fewer than half the calls of plain exponential backoff
           measured: 212 calls against 611 (Brooker 2015, AWS Architecture Blog)

and when the run did not bear it out, ``[did not hold on this run]`` with ``otherwise`` (why a
run can miss it), so the page never reads the opposite of the numbers printed above it.

Every claim is also written into the cell's output as :data:`MIME` data; the test suite runs
every chapter twice on a loaded machine and fails when a claim did not hold in either run
(``tests/test_00_notebook_runs.py``): a claim that a loaded laptop cannot bear out is a claim
the chapter must not make.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass

#: The output type a claim travels under in a notebook (beside its text/plain).
MIME = "application/vnd.course.claim+json"
#: The width a claim's lines are wrapped at (JupyterLab at 1,400 px shows about 110).
WIDTH = 104


@dataclass(frozen=True)
class Claim:
    claim: str
    measured: str
    held: bool
    source: str = ""
    otherwise: str = ""

    def _ipython_display_(self) -> None:
        """Nothing: :func:`check` has shown it already (a cell ending in ``check(...)`` would
        otherwise show it twice)."""

    def text(self) -> str:
        mark = "[held]" if self.held else "[did not hold on this run]"
        measured = f"measured: {self.measured}" + (f" ({self.source})" if self.source else "")
        lines = [f"{mark} {self.claim}", measured]
        if not self.held and self.otherwise:
            lines.append(f"why a run can miss it: {self.otherwise}")
        first, *rest = lines
        wrapped = textwrap.wrap(first, WIDTH, subsequent_indent="    ")
        for line in rest:
            wrapped += textwrap.wrap(line, WIDTH, initial_indent="    ", subsequent_indent="      ")
        return "\n".join(wrapped)


def check(claim: str, *, measured: str, held: bool, source: str = "", otherwise: str = "") -> Claim:
    """Show ``claim`` with what was ``measured`` and whether it ``held``; return it.

    ``held`` is computed from the measurement by the caller (a comparison, not a constant).
    ``source`` names where the claim comes from (a paper, a book, the docs); ``otherwise`` says
    why a run can miss it, shown only when it did.
    """
    if not isinstance(held, bool):
        held = bool(held)  # a numpy bool_ from a comparison of arrays
    found = Claim(claim, measured, held, source, otherwise)
    _show(found)
    return found


def _show(found: Claim) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # pragma: no cover - the course always has IPython
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display({"text/plain": found.text(), MIME: asdict(found)}, raw=True)
    else:
        print(found.text())


def found_in(outputs) -> list[Claim]:
    """The claims in a list of nbformat outputs (what the tests read back)."""
    return [Claim(**out["data"][MIME]) for out in outputs if MIME in out.get("data", {})]
