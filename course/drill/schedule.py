"""When each drill card comes back: FSRS, counted in the learner's days as Anki counts them (chapter 14).

**The scheduler** is FSRS (Free Spaced Repetition Scheduler) through the ``fsrs`` package (py-fsrs):
each rating updates the card's difficulty and stability, and the next review is set for when the
predicted recall falls to 90%. Anki offers FSRS as an opt-in alternative to its default SM-2
(Anki 23.10 and later, deck options > FSRS); the course uses FSRS alone.

**Days, not instants** (Anki's rule, :class:`course.progress.LearnerDay`): a card with an interval of
a day or more is due on a *day* of the learner's local calendar, which starts at 4 am. Reviewed at
08:10 with a one-day interval, it is due from the first minute of tomorrow, not at 08:10; FSRS's
elapsed time is counted in those days too. Cards in a learning step (1 and 10 minutes) are due at
their instant, and are shown up to ``learn_ahead`` (20 minutes) early when nothing else waits.

**Fuzz** (on for learners): an interval of 3 days or more moves by a few percent, so cards learned
together do not come back together forever. It is drawn from a generator seeded by the card and
its last review, so the label on a button is the interval the rating gives, and a test or a demo
that turns it off (``fuzz=False``) gets FSRS's dates exactly.

**Design prompts** are scheduled in days only (no 1- and 10-minute steps: a 35-minute design does
not come back in ten minutes). **Leeches**: a card forgotten ``leech_lapses`` times once learned
(8, Anki's default) is suspended and reported, as Anki does, and again every half that many.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from copy import copy
from dataclasses import dataclass
from datetime import datetime, timedelta

from course.drill.deck import PROMPTS, Card
from course.progress import LearnerDay, Review, Store, due_day, utcnow

#: Anki's default: a card is a leech after 8 lapses (Anki manual, "Leeches").
LEECH_LAPSES = 8
#: The structure a timed design answer fills, in order, and its time.
DESIGN_STEPS = ["requirements", "estimates", "API", "data model", "high-level design", "bottlenecks"]
DESIGN_MINUTES = 35


def scheduler(*, days_only: bool = False):
    """The FSRS scheduler every session uses: the package's defaults (90% desired retention,
    learning steps of 1 and 10 minutes; none with ``days_only``, for design prompts). Fuzz is the
    session's (:func:`fuzzed_days`), so this one has none."""
    import fsrs

    steps = {"learning_steps": (), "relearning_steps": ()} if days_only else {}
    return fsrs.Scheduler(enable_fuzzing=False, **steps)


def fuzzed_days(days: int, seed: str, maximum: int = 36500) -> int:
    """``days`` moved within FSRS's fuzz range (about ±15% at a week, ±5% past 20 days), drawn
    from a generator seeded by ``seed``; intervals under 3 days are not fuzzed (py-fsrs's ranges)."""
    from fsrs.scheduler import FUZZ_RANGES

    if days < 2.5:
        return days
    delta = 1.0 + sum(r["factor"] * max(min(float(days), r["end"]) - r["start"], 0.0) for r in FUZZ_RANGES)
    low, high = max(2, round(days - delta)), min(round(days + delta), maximum)
    low = min(low, high)
    return low + int(random.Random(seed).random() * (high - low + 1))


@dataclass
class _Done:
    card: Card
    review: Review
    came_from: str  # "learning", "reviews" or "new": where undo puts it back
    suspended: bool  # the rating made it a leech and suspended it


class Session:
    """A review session over ``deck``: learning cards whose step is over first, then the cards due
    today (oldest first), then new cards up to ``new_per_day`` a learner's day across the whole
    course (whatever ``deck`` was filtered to; ``new_limit_per="deck"`` counts only ``deck``'s, for a
    practice session of its own). ``clock`` returns an aware UTC datetime (inject one);
    ``day`` is the learner's calendar (default: this machine's local time, 4 am rollover)."""

    def __init__(
        self,
        deck: list[Card],
        store: Store | None = None,
        *,
        clock: Callable[[], datetime] = utcnow,
        new_per_day: int = 20,
        learn_ahead: timedelta = timedelta(minutes=20),
        day: LearnerDay | None = None,
        fuzz: bool = True,
        leech_lapses: int = LEECH_LAPSES,
        new_limit_per: str = "course",
    ) -> None:
        import fsrs

        self.deck, self.store, self.clock = deck, store or Store(), clock
        self.learn_ahead, self.day, self.fuzz, self.leech_lapses = (
            learn_ahead,
            day or LearnerDay(),
            fuzz,
            leech_lapses,
        )
        self.scheduler, self.design_scheduler = scheduler(), scheduler(days_only=True)
        now = clock()
        today = self.day.of(now)
        self.states = {cid: fsrs.Card.from_json(text) for cid, text in self.store.card_states().items()}
        self.lapses = self.store.lapses()
        hidden = {
            cid
            for cid, (suspended, buried) in self.store.flags().items()
            if suspended or (buried and buried >= today)
        }
        cards = [c for c in deck if c.id not in hidden]
        self.learning = [c for c in cards if c.id in self.states and self._due_day(c) is None]
        self.reviews = sorted(
            (c for c in cards if c.id in self.states and (d := self._due_day(c)) is not None and d <= today),
            key=lambda c: (self._due_day(c), self.states[c.id].due),
        )
        seen_today = self.store.new_cards_seen(self.day.start(now))  # every chapter's: one limit a day
        if new_limit_per == "deck":  # a practice session of its own (chapter 14's design prompts)
            seen_today &= {c.id for c in deck}
        order = list(PROMPTS)  # new cards take turns across chapters and kinds: #1 of each section first
        new = sorted(
            (c for c in cards if c.id not in self.states), key=lambda c: (c.number, order.index(c.kind))
        )
        self.new = new[: max(0, new_per_day - len(seen_today))]
        self.counts = {"due": len(self.reviews) + len(self._learning(now)), "new": len(self.new)}
        self.done = 0
        self.leeches: set[str] = set()
        self._history: list[_Done] = []
        self._again: Card | None = None  # the card an undo brought back: shown next

    # -- the queue ---------------------------------------------------------------------------

    def _due_day(self, card: Card):
        state = self.states[card.id]
        return due_day(
            {
                "due": state.due.isoformat(),
                "last_review": state.last_review and state.last_review.isoformat(),
            },
            self.day,
        )

    def _learning(self, until: datetime) -> list[Card]:
        return sorted(
            (c for c in self.learning if self.states[c.id].due <= until), key=lambda c: self.states[c.id].due
        )

    def next(self) -> Card | None:
        """The card to show now: a learning card whose step is over, a due card, a new card, or
        a learning card at most ``learn_ahead`` early when nothing else is left; else None."""
        if self._again is not None:
            return self._again
        now = self.clock()
        ready = self._learning(now)
        if ready:
            return ready[0]
        if self.reviews:
            return self.reviews[0]
        if self.new:
            return self.new[0]
        ahead = self._learning(now + self.learn_ahead)
        return ahead[0] if ahead else None

    @property
    def queue(self) -> list[Card]:
        """Every card this session still holds, in the order it would show them now."""
        now = self.clock()
        ready = self._learning(now)
        later = [c for c in sorted(self.learning, key=lambda c: self.states[c.id].due) if c not in ready]
        return ([self._again] if self._again else []) + ready + self.reviews + self.new + later

    def left(self) -> dict[str, int]:
        """What is left, as Anki counts it: new cards, cards in a learning step, cards due today."""
        return {"new": len(self.new), "learning": len(self.learning), "review": len(self.reviews)}

    def later(self) -> datetime | None:
        """When the next learning card comes back, if the session has nothing to show before it."""
        return min((self.states[c.id].due for c in self.learning), default=None)

    def is_new(self, card: Card) -> bool:
        return card.id not in self.states

    # -- rating --------------------------------------------------------------------------------

    def _on_days(self, state, now: datetime):
        """``state`` as FSRS must see it: the time since the last review counted in the learner's
        days (Anki's rule: reviewed yesterday evening, due this morning, that is one day)."""
        if state.last_review is None:
            return state
        days = (self.day.of(now) - self.day.of(state.last_review)).days
        if days <= 0:
            return state
        shifted = copy(state)
        shifted.last_review = now - timedelta(days=days)
        return shifted

    def _outcome(self, card: Card, before, rating: int, now: datetime):
        """The card after ``rating``, from the state ``before`` (None: new): FSRS on days, then fuzz."""
        import fsrs

        sched = self.design_scheduler if card.kind == "design" else self.scheduler
        state = self._on_days(before, now) if before else fsrs.Card(card_id=card.fsrs_id, due=now)
        after, _log = sched.review_card(state, fsrs.Rating(int(rating)), now)
        days = round((after.due - now).total_seconds() / 86400)
        if self.fuzz and after.state == fsrs.State.Review and days >= 3:
            last = before.last_review.isoformat() if before and before.last_review else "new"
            seed = f"{card.id}|{last}|{rating}"
            after.due = now + timedelta(days=fuzzed_days(days, seed, sched.maximum_interval))
        recall = sched.get_card_retrievability(state, now) if before else None
        return after, recall

    def preview(self, card: Card) -> dict[int, str]:
        """rating -> when each rating would bring the card back ("in 10 minutes", "in 3 days")."""
        now = self.clock()
        return {
            r: when(self._outcome(card, self.states.get(card.id), r, now)[0].due, now) for r in (1, 2, 3, 4)
        }

    def rate(self, card: Card, rating: int, *, answer: str = "", seconds: float | None = None) -> datetime:
        """Record ``rating`` (1 Again, 2 Hard, 3 Good, 4 Easy) for ``card``; return its next due date.

        The new state is computed from the card's state *as stored*, inside the transaction that
        saves it (:meth:`course.progress.Store.review`): another session that rated the card in the
        meantime (a terminal beside the notebook) is built upon, never overwritten."""
        import fsrs

        now = self.clock()

        def decide(stored: str | None) -> tuple[str, dict]:
            before = fsrs.Card.from_json(stored) if stored else None
            after, recall = self._outcome(card, before, rating, now)
            return after.to_json(), {
                "state_before": int(before.state) if before else None,
                "recall_p": recall,
            }

        review = self.store.review(
            card.id, card.chapter, decide, rating=int(rating), reviewed_at=now, answer=answer, seconds=seconds
        )
        after = fsrs.Card.from_json(review.fsrs_after)
        came_from = self._take(card)
        self.states[card.id] = after
        if self._due_day(card) is None:  # a learning step: it comes back today
            self.learning.append(card)
        suspended = False
        lapsed = (
            int(rating) == 1
            and review.fsrs_before
            and fsrs.Card.from_json(review.fsrs_before).state == fsrs.State.Review
        )
        self.lapses[card.id] = review.lapses
        if (
            lapsed
            and review.lapses >= self.leech_lapses
            and (review.lapses - self.leech_lapses) % max(1, self.leech_lapses // 2) == 0
        ):
            self.leeches.add(card.id)
            self.store.suspend(card.id)
            self._take(card)
            suspended = True
        self._history.append(_Done(card, review, came_from, suspended))
        self.done += 1
        return after.due

    def _take(self, card: Card) -> str:
        """Remove ``card`` from whichever list holds it; say which."""
        if self._again is card:
            self._again = None
        for name in ("learning", "reviews", "new"):
            cards = getattr(self, name)
            if card in cards:
                cards.remove(card)
                return name
        return "learning"

    def undo(self) -> Card | None:
        """Take back the last rating of this session: the card gets its state before it and is
        shown next. None when there is nothing to undo, or another session reviewed the card since."""
        import fsrs

        if not self._history:
            return None
        last = self._history[-1]
        if not self.store.undo(last.review):
            return None
        self._history.pop()
        card = last.card
        self._take(card)
        if last.review.fsrs_before is None:
            self.states.pop(card.id, None)
        else:
            self.states[card.id] = fsrs.Card.from_json(last.review.fsrs_before)
        if last.suspended:
            self.store.suspend(card.id, False)
            self.leeches.discard(card.id)
        self.lapses[card.id] = self.store.lapses().get(card.id, 0)
        getattr(self, last.came_from).insert(0, card)
        self._again = card
        self.done -= 1
        return card

    def suspend(self, card: Card) -> None:
        """Never show ``card`` again until it is unsuspended (``course drill --unsuspend ID``)."""
        self.store.suspend(card.id)
        self._take(card)

    def bury(self, card: Card) -> None:
        """Hide ``card`` for the rest of the learner's day."""
        self.store.bury(card.id, self.day.of(self.clock()))
        self._take(card)


def when(due: datetime, now: datetime) -> str:
    """'in 10 minutes', 'in 3 days' (what a learner reads after rating)."""
    seconds = (due - now).total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = round(seconds / size)
            return f"in {n} {unit}{'s' if n != 1 else ''}"
    return "now"
