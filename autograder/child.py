"""What a check's child process (a replica on another host) rebuilds before it runs an answer.

The grader sends the answer cell's source and, from :func:`autograder.probes._environment`, the
notebook names that cell uses: ``["module", name, module]``, ``["attr", name, module, qualname]``
``["value", name, value]`` or ``["bytes", name, hex]``. Standard library only: it runs first in every child.
"""

from __future__ import annotations

import importlib


def build_namespace(spec: dict) -> dict:
    """The answer cell's globals: the names it uses from the notebook, then the cell itself run."""
    ns: dict = {"__name__": "__learner__"}
    for entry in spec["env"]:
        try:
            if entry[0] == "module":
                ns[entry[1]] = importlib.import_module(entry[2])
            elif entry[0] == "attr":
                obj = importlib.import_module(entry[2])
                for part in entry[3].split("."):
                    obj = getattr(obj, part)
                ns[entry[1]] = obj
            elif entry[0] == "bytes":
                ns[entry[1]] = bytes.fromhex(entry[2])
            else:
                ns[entry[1]] = entry[2]
        except Exception:  # noqa: BLE001, S110 - a name that cannot come back: the cell's own error names it
            pass
    if spec["source"]:
        exec(compile(spec["source"], spec["filename"], "exec", dont_inherit=True), ns)  # noqa: S102 - the learner's answer, sandboxed
    return ns
