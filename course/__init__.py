"""Resilient Backend Patterns, a live workbook: the package behind the notebooks.

Each module holds one pattern's reference implementation and names the chapter that
teaches it; :mod:`course.backends` and :mod:`course.lab` give every run live, isolated
Redis and PostgreSQL; :mod:`course.faults` holds the fault tools.
"""

__version__ = "0.1.0"
