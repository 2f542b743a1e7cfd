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

from course.drill import DESIGN_MINUTES, DESIGN_STEPS, KIND_NAMES, PROMPTS, Card, Session, when
from course.progress import LearnerDay, Store, due_day

RATINGS = [(1, "Again"), (2, "Hard"), (3, "Good"), (4, "Easy")]
#: The calendar of the demos: UTC, Anki's 4 am rollover (a learner's own sessions use local time).
DEMO_DAY = LearnerDay(tz=UTC)


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
    start: datetime | None = None,
) -> dict:
    """A simulated learner drills every morning at 08:00 for ``days`` days, through the real
    :class:`Session` (demo calendar, fuzz off, so a run is reproducible).

    The learner's memory *is* FSRS's forgetting curve (recall with the probability the scheduler
    predicts, minus ``slip``): recall near 90% is what FSRS promises by construction when a review
    comes on its day. What the run measures is the session: how late reviews come (in the learner's
    days), the recall that follows, and the load. Recalled cards are rated Good (Hard or Easy one
    time in ten each), forgotten ones Again. Returns per-day counts and the lateness of each review."""
    rng = random.Random(seed)
    clock = Clock(start)
    per_day, late = [], []
    for day in range(days):
        session = Session(deck, store, clock=clock, new_per_day=new_per_day, day=DEMO_DAY, fuzz=False)
        stats = Counter(due=session.counts["due"], new=session.counts["new"])
        while (card := session.next()) is not None:
            state = session.states.get(card.id)
            if state is None:  # a new card: the learner knows about half of them already
                remembered = rng.random() < 0.5
            else:
                if (on := due_day(_as_dict(state), DEMO_DAY)) is not None:
                    late.append((DEMO_DAY.of(clock()) - on).days)
                recall = session.scheduler.get_card_retrievability(session._on_days(state, clock()), clock())
                remembered = rng.random() < recall * (1 - slip)
            rating = rng.choice([2, 3, 3, 3, 3, 3, 3, 3, 3, 4]) if remembered else 1
            session.rate(card, rating)
            clock.advance(minutes=1 if rating > 1 else 2)  # a minute per card, two when it was forgotten
            stats["reviews"] += 1
        per_day.append(dict(stats, day=day))
        clock.now = clock.now.replace(hour=8, minute=0) + timedelta(days=1)
    return {"days": per_day, "end": clock(), "lateness": late}


def _as_dict(state) -> dict:
    return {"due": state.due.isoformat(), "last_review": state.last_review and state.last_review.isoformat()}


def history(store: Store, day: LearnerDay | None = None) -> list[dict]:
    """Per learner's day from the first review to the last, days without reviews included: new,
    learning and review counts; the recalled share of reviews of cards already learned (observed
    retention) and the mean recall FSRS predicted for them."""
    day = day or LearnerDay()
    days: dict = defaultdict(Counter)
    predicted: dict = defaultdict(list)
    for r in store.reviews():
        on = day.of(r["reviewed_at"])
        if r["state_before"] is None:
            days[on]["new"] += 1
        elif r["state_before"] == 2:  # fsrs.State.Review: a card that had been learned
            days[on]["review"] += 1
            days[on]["recalled"] += r["rating"] > 1
            if r["recall_p"] is not None:
                predicted[on].append(r["recall_p"])
        else:
            days[on]["learning"] += 1
    if not days:
        return []
    first, last = min(days), max(days)
    out = []
    for i in range((last - first).days + 1):
        on = first + timedelta(days=i)
        c = days.get(on, Counter())
        out.append(
            {
                "day": on,
                "new": c["new"],
                "review": c["review"],
                "learning": c["learning"],
                "retention": c["recalled"] / c["review"] if c["review"] else None,
                "predicted": sum(predicted[on]) / len(predicted[on]) if predicted[on] else None,
            }
        )
    return out


def plot_history(store: Store, *, title: str = "your reviews", day: LearnerDay | None = None):
    """Reviews per day (stacked: new, learning, review) and retention (observed and predicted)."""
    from course.kit import plotting

    rows = history(store, day)
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
    ax.set_xlabel(f"day ({rows[0]['day']} to {rows[-1]['day']}, days without reviews included)")
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


class HistoryView:
    """The history plot in an output area, with a Redraw button; a :class:`DrillWidget` given to
    it (``watch``) redraws it when its session runs out of cards."""

    def __init__(self, store: Store, *, title: str = "your reviews (this state file)") -> None:
        import ipywidgets as w

        self.store, self.title = store, title
        self.out = w.Output()
        self.button = w.Button(description="Redraw", tooltip="draw the plot again from the state file")
        self.button.on_click(lambda _b: self.redraw())
        self.box = w.VBox([self.button, self.out])
        self.redraw()

    def redraw(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import display

        fig = plot_history(self.store, title=self.title)
        with self.out:
            self.out.clear_output(wait=True)
            display(fig)
        plt.close(fig)

    def watch(self, widget: DrillWidget) -> None:
        widget.on_done.append(self.redraw)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.box)


# ----------------------------------------------------------------------------- the widget


def _html(markdown: str) -> str:
    import mistune

    return mistune.html(markdown)


def timer_html(minutes: int = DESIGN_MINUTES, *, token: str = "") -> str:
    """A timer drawn by the browser alone (CSS animations: no kernel message while it runs, so the
    kernel's own output, plots included, is never disturbed). It starts when it is shown and counts
    whole minutes: "12 of 35 minutes", over a bar that fills. ``token`` makes each card's timer a new
    element, so it starts again from zero."""
    seconds = minutes * 60
    return f"""<div class="course-drill-timer" data-card="{token}">
<style>
@property --course-drill-minutes {{ syntax: '<integer>'; inherits: false; initial-value: 0; }}
@keyframes course-drill-count {{
  from {{ --course-drill-minutes: 0; }} to {{ --course-drill-minutes: {minutes}; }} }}
@keyframes course-drill-fill {{ from {{ width: 0%; }} to {{ width: 100%; }} }}
.course-drill-timer .course-drill-elapsed {{
  animation: course-drill-count {seconds}s steps({minutes}, end) forwards;
  counter-reset: minutes var(--course-drill-minutes); font-variant-numeric: tabular-nums; }}
.course-drill-timer .course-drill-elapsed::before {{ content: counter(minutes) " of {minutes} minutes"; }}
.course-drill-timer .course-drill-track {{ width: 20em; height: .5em; background: #ecf0f1; }}
.course-drill-timer .course-drill-bar {{ height: 100%; background: #2980b9;
  animation: course-drill-fill {seconds}s linear forwards; }}
</style>
<span class="course-drill-elapsed"></span> (timer started when this prompt was shown)
<div class="course-drill-track"><div class="course-drill-bar"></div></div>
</div>"""


class DrillWidget:
    """A review session in JupyterLab: the question (and its snippet or prompt), a box for your
    answer, "Show answer", then Again / Hard / Good / Easy, each labelled with when the card
    would come back. Tab moves between the controls; Enter or Space presses a button.

    A design prompt also shows a 35-minute timer (drawn by the browser, so the kernel stays free)
    and one box per step of the structure. The header counts what is left, as Anki does: new
    cards, cards in a learning step, cards due today."""

    def __init__(
        self,
        deck: list[Card],
        store: Store,
        *,
        clock: Callable[[], datetime] | None = None,
        new_per_day: int = 20,
        day: LearnerDay | None = None,
        fuzz: bool = True,
        new_limit_per: str = "course",
    ) -> None:
        import ipywidgets as w

        kwargs = {"clock": clock} if clock else {}
        self.session = Session(
            deck, store, new_per_day=new_per_day, day=day, fuzz=fuzz, new_limit_per=new_limit_per, **kwargs
        )
        self.current: Card | None = None
        self.shown_at: datetime | None = None
        self.on_done: list[Callable[[], None]] = []
        self.header = w.HTML()
        self.front = w.HTML()
        self.notes = w.Textarea(
            placeholder="your answer (optional: answering aloud works too)",
            layout=w.Layout(width="95%", height="90px"),
        )
        self.steps = {
            s: w.Textarea(placeholder=s, layout=w.Layout(width="95%", height="48px")) for s in DESIGN_STEPS
        }
        self.timer = w.HTML()
        self.design = w.VBox(
            [self.timer, *[w.VBox([w.HTML(f"<b>{s}</b>"), t]) for s, t in self.steps.items()]]
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
        self.undo_button = w.Button(
            description="Undo", tooltip="take back the last rating", layout=w.Layout(width="auto")
        )
        self.undo_button.on_click(self._undo)
        self.status = w.HTML()
        self.box = w.VBox(
            [
                self.header,
                self.front,
                self.notes,
                self.design,
                self.show,
                self.back,
                w.HBox([*self.buttons, self.undo_button]),
                self.status,
            ]
        )
        self.box.add_class("course-drill")
        self._load()

    def _ipython_display_(self):
        from IPython.display import display

        display(self.box)

    def left(self) -> str:
        left = self.session.left()
        return f"{left['new']} new · {left['learning']} learning · {left['review']} review left"

    def _load(self) -> None:
        card = self.current = self.session.next()
        self.back.value = ""
        for b in self.buttons:
            b.disabled = True
        if card is None:
            later = self.session.later()
            back = (
                f" Cards in a learning step come back {when(later, self.session.clock())}." if later else ""
            )
            self.header.value = (
                f"<b>Done for now</b>: {self.session.done} reviewed. "
                f"<span class='course-drill-left'>{self.left()}</span>"
            )
            self.front.value = f"Nothing else is due; new cards wait for tomorrow's limit.{back}"
            self.timer.value = ""
            for part in (self.notes, self.design, self.show):
                part.layout.display = "none"
            for callback in self.on_done:
                callback()
            return
        self.shown_at = self.session.clock()
        self.header.value = (
            f"<span class='course-drill-where'>chapter {card.chapter} {card.chapter_title} | "
            f"{KIND_NAMES[card.kind]} | {'new' if self.session.is_new(card) else 'due'}</span> | "
            f"<span class='course-drill-left'>{self.left()}</span>"
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
        self.timer.value = timer_html(token=f"{card.id}-{self.session.done}") if design else ""
        self.show.layout.display = None
        self.show.disabled = False

    def _show(self, _button=None) -> None:
        card = self.current
        if card is None:
            return
        took = ""
        if card.kind == "design":
            minutes = (self.session.clock() - self.shown_at).total_seconds() / 60
            took = f"<p>time: {minutes:.0f} of {DESIGN_MINUTES} minutes</p>"
            self.timer.value = ""  # the timer stops with the answer
        links = "".join(f"<li><a href='{url}' target='_blank'>{title}</a></li>" for title, url in card.links)
        notes = self.session.store.last_notes(card.id)
        last = (
            f"<p><b>Your notes from {notes[0].astimezone():%Y-%m-%d}</b></p>{_html(notes[1])}"
            if notes
            else ""
        )
        self.back.value = (
            f"<div class='course-drill-answer'><hr>{took}{_html(card.back)}"
            f"<p><small>{card.source}</small></p>{'<ul>' + links + '</ul>' if links else ''}{last}</div>"
        )
        preview = self.session.preview(card)
        for b, (value, name) in zip(self.buttons, RATINGS, strict=True):
            b.description = f"{name} ({preview[value]})"
            b.disabled = False
        self.show.disabled = True

    def _rate(self, value: int) -> None:
        card = self.current
        if card is None:
            return
        notes = (
            self.notes.value
            if card.kind != "design"
            else "\n".join(f"{s}: {t.value}" for s, t in self.steps.items() if t.value)
        )
        seconds = (self.session.clock() - self.shown_at).total_seconds() if self.shown_at else None
        due = self.session.rate(card, value, answer=notes, seconds=seconds)
        name = dict(RATINGS)[value]
        leech = (
            " It is a leech (forgotten 8 times): suspended; rewrite your notes for it."
            if card.id in self.session.leeches
            else ""
        )
        self.status.value = (
            f"<span class='course-drill-status'>{name}: next review "
            f"{when(due, self.session.clock())} ({due.astimezone():%Y-%m-%d %H:%M} your time).{leech}</span>"
        )
        self._load()

    def _undo(self, _button=None) -> None:
        card = self.session.undo()
        self.status.value = (
            f"<span class='course-drill-status'>took back the rating of: {card.front}</span>"
            if card
            else "<span class='course-drill-status'>nothing to undo</span>"
        )
        self._load()
