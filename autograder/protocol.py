"""The order a grading run reports in, and what breaks it (issue 26): a result the job did not ask for earns nothing."""

from __future__ import annotations


def protocol_errors(job: dict, events: list[dict]) -> dict[str, str]:
    """task id -> what was wrong with its results in ``events``, for the tasks whose results cannot count.

    The runner reports, in the job's order: ``start`` and ``cell`` for each setup and answer
    cell, ``task-start`` and then ``task`` for each test (no ``task`` for a task cut by an
    earlier run), then ``done``. A result out of that order, a second result for a task, a
    result for a task whose checks never started, or one after ``done`` is not the grader's
    doing: that task, and every task reported after the first such event, earns nothing.
    """
    expected: list[tuple[str, str, bool]] = []  # (event, id, optional)
    for cell in job["cells"]:
        if cell["kind"] == "test":
            expected.append(("task-start", cell["task"], False))
            expected.append(("task", cell["task"], True))
        else:
            expected.append(("start", cell["id"], False))
            expected.append(("cell", cell["id"], False))
    expected.append(("done", "", False))
    broken: dict[str, str] = {}
    position, derailed = 0, None
    for event in events:
        kind = event.get("event")
        if kind in ("forged", "error"):
            continue
        ident = str(event.get("id", event.get("cell", "")) if kind != "done" else "")
        if derailed is None:
            while position < len(expected) and expected[position][2] and expected[position][:2] != (kind, ident):
                position += 1  # an optional result that did not come (a task cut by an earlier run)
            if position < len(expected) and expected[position][:2] == (kind, ident):
                position += 1
                continue
            if kind == "task" and any(e[:2] == ("task", ident) for e in expected[:position]):
                derailed = f"a second result for {ident}"
            elif kind == "task":
                derailed = f"a result for {ident} before its checks started"
            else:
                derailed = f"'{kind}' for {ident or 'the run'} out of the job's order"
        if kind in ("task", "task-start"):
            broken.setdefault(ident, derailed)
    if derailed is not None:  # every task not yet reported when the order broke
        reported = {e[1] for e in expected[:position] if e[0] == "task"}
        for cell in job["cells"]:
            if cell["kind"] == "test" and cell["task"] not in reported:
                broken.setdefault(cell["task"], derailed)
    return broken
