"""Chapter 14 (interview drills): the drill session widget, the design-prompt timer, a simulated
month of reviews and the plots of a learner's history.

The deck, the scheduler and the state are :mod:`course.drill` and :mod:`course.progress`
(``course drill`` in a terminal uses the same); this module only shows them in JupyterLab.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from course.drill import DESIGN_MINUTES, DESIGN_STEPS, KIND_NAMES, PROMPTS, Card, Session
from course.progress import Store

RATINGS = [(1, "Again"), (2, "Hard"), (3, "Good"), (4, "Easy")]


class Clock:
    """An injected clock for sessions: ``clock()`` is the time; ``advance(days=1)`` moves it."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime(2026, 1, 5, 8, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **delta: float) -> datetime:
        self.now += timedelta(**delta)
        return self.now


def deck_table(deck: list[Card]) -> str:
    """Markdown: cards per chapter and kind."""
    kinds = [k for k in PROMPTS if any(c.kind == k for c in deck)]
    counts: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for card in deck:
        counts[(card.chapter, card.chapter_title)][card.kind] += 1
    rows = [
        "| chapter | " + " | ".join(KIND_NAMES[k] for k in kinds) + " | cards |",
        "|---|" + "---:|" * (len(kinds) + 1),
    ]
    for (chapter, title), c in sorted(counts.items()):
        rows.append(
            f"| {chapter} {title} | " + " | ".join(str(c[k] or "") for k in kinds) + f" | {sum(c.values())} |"
        )
    total = Counter(card.kind for card in deck)
    rows.append("| **all** | " + " | ".join(f"**{total[k]}**" for k in kinds) + f" | **{len(deck)}** |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- simulation


def simulate_month(
    deck: list[Card],
    store: Store,
    *,
    days: int = 30,
    new_per_day: int = 10,
    seed: int = 14,
    slip: float = 0.0,
) -> dict:
    """A simulated learner drills every morning for ``days`` days, through the real :class:`Session`.

    The learner's memory is FSRS's own forgetting curve (recall with the probability the
    scheduler predicts, plus ``slip``: a chance of forgetting anyway); recalled cards are
    rated Good (Hard or Easy one time in ten each), forgotten ones Again. Returns per-day counts."""
    rng = random.Random(seed)
    clock = Clock()
    per_day = []
    for day in range(days):
        session = Session(deck, store, clock=clock, new_per_day=new_per_day)
        stats = Counter(due=session.counts["due"], new=session.counts["new"])
        while (card := session.next()) is not None:
            state = session.states.get(card.id)
            recall = session.scheduler.get_card_retrievability(state, clock()) if state else 0.0
            if state is None:  # a new card: the learner knows about half of them already
                remembered = rng.random() < 0.5
            else:
                remembered = rng.random() < recall * (1 - slip)
            rating = rng.choice([2, 3, 3, 3, 3, 3, 3, 3, 3, 4]) if remembered else 1
            session.rate(card, rating)
            clock.advance(minutes=1 if rating > 1 else 2)  # a minute per card, two when it was forgotten
            stats["reviews"] += 1
        per_day.append(dict(stats, day=day))
        clock.now = clock.now.replace(hour=8, minute=0) + timedelta(days=1)
    return {"days": per_day, "end": clock()}


def history(store: Store) -> dict:
    """Per calendar day of ``store``'s reviews: new, review, relearn counts; recalled share of
    reviews of cards already learned (observed retention) and the mean predicted recall."""
    days: dict = defaultdict(Counter)
    predicted: dict = defaultdict(list)
    for r in store.reviews():
        day = r["reviewed_at"].date()
        if r["state_before"] is None:
            days[day]["new"] += 1
        elif r["state_before"] == 2:  # fsrs.State.Review: a card that had been learned
            days[day]["review"] += 1
            days[day]["recalled"] += r["rating"] > 1
            if r["recall_p"] is not None:
                predicted[day].append(r["recall_p"])
        else:
            days[day]["learning"] += 1
    out = []
    for day in sorted(days):
        c = days[day]
        out.append(
            {
                "day": day,
                "new": c["new"],
                "review": c["review"],
                "learning": c["learning"],
                "retention": c["recalled"] / c["review"] if c["review"] else None,
                "predicted": sum(predicted[day]) / len(predicted[day]) if predicted[day] else None,
            }
        )
    return out


def plot_history(store: Store, *, title: str = "your reviews"):
    """Reviews per day (stacked: new, learning, review) and retention (observed and predicted)."""
    from course.kit import plotting

    rows = history(store)
    fig, ax = plotting.figure(9, 3.2)
    if not rows:
        ax.text(
            0.5,
            0.5,
            "no reviews yet: run a drill session above",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        ax.set_axis_off()
        return fig
    x = list(range(len(rows)))
    bottom = [0] * len(rows)
    for key, color in (
        ("new", plotting.COLORS["fix"]),
        ("learning", plotting.COLORS["warn"]),
        ("review", plotting.COLORS["neutral"]),
    ):
        values = [r[key] for r in rows]
        ax.bar(x, values, bottom=bottom, color=color, label=f"{key} cards")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set_xlabel(f"day ({rows[0]['day']} to {rows[-1]['day']})")
    ax.set_ylabel("reviews")
    ax.set_title(title)
    right = ax.twinx()
    for key, color, label in (
        ("retention", plotting.COLORS["ok"], "recalled (observed)"),
        ("predicted", plotting.COLORS["bad"], "recall predicted by FSRS"),
    ):
        pts = [(i, r[key]) for i, r in enumerate(rows) if r[key] is not None]
        if pts:
            right.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=label, markersize=3)
    right.set_ylim(0, 1.05)
    right.set_ylabel("share of learned cards")
    handles = ax.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    ax.legend(
        handles[0] + more[0],
        handles[1] + more[1],
        loc="upper left",
        bbox_to_anchor=(1.08, 1.0),
        frameon=False,
        fontsize="small",
    )
    return fig


# ----------------------------------------------------------------------------- the widget


def _html(markdown: str) -> str:
    import mistune

    return mistune.html(markdown)


class DrillWidget:
    """A review session in JupyterLab: the question (and its snippet or prompt), a box for your
    answer, "Show answer", then Again / Hard / Good / Easy, each labelled with when the card
    would come back. Tab moves between the controls; Enter or Space presses a button.

    A design prompt also shows a 35-minute timer (run by the browser, so the kernel stays free)
    and one box per step of the structure."""

    def __init__(
        self,
        deck: list[Card],
        store: Store,
        *,
        clock: Callable[[], datetime] | None = None,
        new_per_day: int = 20,
    ) -> None:
        import ipywidgets as w

        kwargs = {"clock": clock} if clock else {}
        self.session = Session(deck, store, new_per_day=new_per_day, **kwargs)
        self.header = w.HTML()
        self.front = w.HTML()
        self.notes = w.Textarea(
            placeholder="your answer (optional: answering aloud works too)",
            layout=w.Layout(width="95%", height="90px"),
        )
        self.steps = {
            s: w.Textarea(placeholder=s, layout=w.Layout(width="95%", height="48px")) for s in DESIGN_STEPS
        }
        self.timer = w.Play(value=0, min=0, max=DESIGN_MINUTES * 60, interval=1000, show_repeat=False)
        self.elapsed = w.IntProgress(value=0, min=0, max=DESIGN_MINUTES * 60, description="35 min")
        w.jslink((self.timer, "value"), (self.elapsed, "value"))
        self.design = w.VBox(
            [
                w.HBox([self.timer, self.elapsed]),
                *[w.VBox([w.HTML(f"<b>{s}</b>"), t]) for s, t in self.steps.items()],
            ]
        )
        self.show = w.Button(description="Show answer", button_style="info", tooltip="open the model answer")
        self.show.on_click(self._show)
        self.back = w.HTML()
        self.buttons = []
        for value, name in RATINGS:
            b = w.Button(
                description=name, disabled=True, tooltip=f"rate {name}", layout=w.Layout(width="auto")
            )
            b.on_click(lambda _b, value=value: self._rate(value))
            self.buttons.append(b)
        self.status = w.HTML()
        self.box = w.VBox(
            [
                self.header,
                self.front,
                self.notes,
                self.design,
                self.show,
                self.back,
                w.HBox(self.buttons),
                self.status,
            ]
        )
        self.box.add_class("course-drill")
        self._load()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.box)

    def _load(self) -> None:
        card = self.session.next()
        self.back.value = ""
        for b in self.buttons:
            b.disabled = True
        if card is None:
            self.header.value = f"<b>Done for now</b>: {self.session.done} reviewed."
            self.front.value = "Nothing else is due; new cards wait for tomorrow's limit."
            for part in (self.notes, self.design, self.show):
                part.layout.display = "none"
            return
        left = len(self.session.queue)
        self.header.value = (
            f"<span class='course-drill-where'>chapter {card.chapter} {card.chapter_title} | "
            f"{KIND_NAMES[card.kind]} | {'new' if self.session.is_new(card) else 'due'} | "
            f"{left} left</span>"
        )
        self.front.value = (
            f"<i>{PROMPTS[card.kind]}</i>" + _html(card.front) + (_html(card.context) if card.context else "")
        )
        design = card.kind == "design"
        self.notes.value = ""
        self.notes.layout.display = "none" if design else None
        self.design.layout.display = None if design else "none"
        for t in self.steps.values():
            t.value = ""
        self.timer.value = 0
        self.timer.playing = design
        self.show.layout.display = None
        self.show.disabled = False

    def _show(self, _button=None) -> None:
        card = self.session.next()
        if card is None:
            return
        self.timer.playing = False
        took = (
            f"<p>time: {self.timer.value // 60} of {DESIGN_MINUTES} minutes</p>"
            if card.kind == "design"
            else ""
        )
        links = "".join(f"<li><a href='{url}' target='_blank'>{title}</a></li>" for title, url in card.links)
        self.back.value = (
            f"<div class='course-drill-answer'><hr>{took}{_html(card.back)}"
            f"<p><small>{card.source}</small></p>{'<ul>' + links + '</ul>' if links else ''}</div>"
        )
        preview = self.session.preview(card)
        for b, (value, name) in zip(self.buttons, RATINGS, strict=True):
            b.description = f"{name} ({preview[value]})"
            b.disabled = False
        self.show.disabled = True

    def _rate(self, value: int) -> None:
        card = self.session.next()
        if card is None:
            return
        notes = (
            self.notes.value
            if card.kind != "design"
            else "\n".join(f"{s}: {t.value}" for s, t in self.steps.items() if t.value)
        )
        due = self.session.rate(card, value, answer=notes)
        from course.drill import when

        name = dict(RATINGS)[value]
        self.status.value = (
            f"<span class='course-drill-status'>{name}: next review "
            f"{when(due, self.session.clock())} ({due:%Y-%m-%d %H:%M} UTC)</span>"
        )
        self._load()
