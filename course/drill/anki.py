"""The deck as an Anki package, with the learner's review history (chapter 14).

``course drill --export deck.apkg`` writes every card as an Anki note (genanki writes the package),
then adds what genanki cannot: each reviewed card's scheduling (due day, interval, lapses, FSRS
memory state) and its whole review log, Anki's ``revlog``, one row per review. In Anki, File >
Import with **Import any learning progress** ticked brings the history along: Anki's FSRS, once
turned on in the deck options, computes each card's memory from those reviews, and its optimizer
can fit its parameters to them. A suspended card (a leech) arrives suspended, tagged ``leech``.

Each note's guid is the card's stable id, so importing a newer export updates the notes in place,
even after a question was reworded. Tested against the real Anki (the ``anki`` package) in
``tests/test_14_sessions.py``.
"""

from __future__ import annotations

import html
import itertools
import json
import os
import sqlite3
import tempfile
import time
import zipfile
from datetime import UTC, datetime
from pathlib import Path

from course.drill.deck import PROMPTS, Card
from course.progress import LearnerDay, Store, due_day

MODEL_ID, DECK_ID = 1_614_032_714, 1_614_032_715
#: Anki's ``cards.type`` / ``revlog.type`` by the fsrs state (before a review, for the log):
#: fsrs 1 Learning, 2 Review, 3 Relearning.
_REVLOG_TYPE = {None: 0, 1: 0, 2: 1, 3: 2}
_CARD_TYPE = {1: 1, 2: 2, 3: 3}


def _notes(deck: list[Card], store: Store | None):
    import genanki
    import mistune

    model = genanki.Model(
        MODEL_ID,
        "Resilient Backend Patterns drill",
        fields=[{"name": n} for n in ("Question", "Context", "Answer", "Source")],
        templates=[
            {
                "name": "Card 1",
                "qfmt": "<div class=kind>{{Source}}</div>{{Question}}"
                "{{#Context}}<div>{{Context}}</div>{{/Context}}",
                "afmt": "{{FrontSide}}<hr id=answer>{{Answer}}",
            }
        ],
        css=".card{font-family:sans-serif;text-align:left;max-width:46em;margin:auto}"
        ".kind{color:#7f8c8d;font-size:small}pre{background:#f6f6f6;padding:.5em}",
    )
    root = genanki.Deck(DECK_ID, "Resilient Backend Patterns")
    flags = store.flags() if store else {}
    for card in deck:
        question = f"<p><i>{html.escape(PROMPTS[card.kind])}</i></p>{mistune.html(card.front)}"
        fields = [
            question,
            mistune.html(card.context) if card.context else "",
            mistune.html(card.back),
            html.escape(card.source),
        ]
        tags = [f"ch{card.chapter}", card.kind] + (["leech"] if flags.get(card.id, (False, None))[0] else [])
        root.add_note(genanki.Note(model=model, fields=fields, guid=genanki.guid_for(card.id), tags=tags))
    return root


def _history(db: sqlite3.Connection, deck: list[Card], store: Store, day: LearnerDay) -> int:
    """Write each reviewed card's scheduling and its review log into the collection ``db``."""
    import genanki

    crt, conf = db.execute("SELECT crt, conf FROM col").fetchone()
    # schedVer 2: four buttons in learning too. Without it Anki reads the log as its first scheduler's,
    # whose learning cards had three buttons, and turns a Good in learning into an Easy.
    db.execute("UPDATE col SET conf = ?", (json.dumps({**json.loads(conf), "schedVer": 2}),))
    crt_day = day.of(datetime.fromtimestamp(crt, UTC))
    by_guid = dict(db.execute("SELECT n.guid, c.id FROM notes n JOIN cards c ON c.nid = n.id"))
    states, flags, lapses = store.card_states(), store.flags(), store.lapses()
    written, used_ids = 0, set()
    for card in deck:
        if card.id not in states:
            continue
        cid = by_guid[genanki.guid_for(card.id)]
        state = json.loads(states[card.id])
        reviews = store.reviews(card.id)
        last_ivl = 0
        for r in reviews:
            rid = int(r["reviewed_at"].timestamp() * 1000)
            while rid in used_ids:  # revlog.id is the review's time in ms, and unique
                rid += 1
            used_ids.add(rid)
            seconds = (r["due_after"] - r["reviewed_at"]).total_seconds()
            ivl = round(seconds / 86400) if seconds >= 86400 else -int(seconds)  # days, or -seconds
            db.execute(
                "INSERT INTO revlog (id, cid, usn, ease, ivl, lastIvl, factor, time, type) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rid,
                    cid,
                    -1,
                    r["rating"],
                    ivl,
                    last_ivl,
                    2500 if ivl > 0 else 0,
                    int(min(r["seconds"] or 0, 60) * 1000),  # Anki caps a review's time at 60 s
                    _REVLOG_TYPE.get(r["state_before"], 1),
                ),
            )
            last_ivl = ivl
        on = due_day(state, day)
        last = datetime.fromisoformat(state["last_review"])
        if on is not None:  # a review card: due on a day counted from the collection's creation
            due, ivl = (on - crt_day).days, max(1, (on - day.of(last)).days)
            kind = _CARD_TYPE.get(state["state"], 2)
            queue = 2 if kind == 2 else 3  # 3: Anki's queue of learning steps counted in days
        else:  # a learning step: due at an instant, in seconds
            kind = queue = _CARD_TYPE.get(state["state"], 1)
            due, ivl = int(datetime.fromisoformat(state["due"]).timestamp()), 0
        if flags.get(card.id, (False, None))[0]:
            queue = -1
        memory = {"s": round(state["stability"], 4), "d": round(state["difficulty"], 4), "dr": 0.9}
        db.execute(
            "UPDATE cards SET type = ?, queue = ?, due = ?, ivl = ?, factor = ?, reps = ?, lapses = ?, "
            "left = ?, "
            "data = ? WHERE id = ?",
            (
                kind,
                queue,
                due,
                ivl,
                2500,
                len(reviews),
                lapses.get(card.id, 0),
                0 if kind == 2 else 1001,
                json.dumps(memory),
                cid,
            ),
        )
        written += 1
    return written


def export_apkg(
    deck: list[Card],
    path: str | Path,
    *,
    store: Store | None = None,
    timestamp: float | None = None,
    day: LearnerDay | None = None,
) -> Path:
    """Write ``deck`` as an Anki package (``.apkg``: a zip holding a SQLite collection), with the
    scheduling and review log of every card ``store`` holds reviews of (none without a store).

    Each card's note has a stable guid from its id, so importing an updated export updates the
    notes in Anki instead of duplicating them; tags name the chapter and the kind."""
    import genanki

    timestamp = time.time() if timestamp is None else timestamp
    package = genanki.Package(_notes(deck, store))
    fd, collection = tempfile.mkstemp(suffix=".anki2")
    os.close(fd)
    try:
        with sqlite3.connect(collection) as db:
            package.write_to_db(db.cursor(), timestamp, itertools.count(int(timestamp * 1000)))
            if store is not None:
                _history(db, deck, store, day or LearnerDay())
        db.close()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path, "w") as out:
            out.write(collection, "collection.anki2")
            out.writestr("media", "{}")
    finally:
        os.unlink(collection)
    return path
