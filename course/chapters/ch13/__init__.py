"""Chapter 13 (the live leaderboard): its demos and its live page. Only chapter 13 imports this.

The notebook calls ``ch13.<name>`` for all three: the demos (:mod:`.demos`), removals and time windows
(:mod:`.changes`), and the page (:mod:`.live`).
"""

from course.chapters.ch13.changes import period_boards, removal_race, versioned_write  # noqa: F401
from course.chapters.ch13.demos import *  # noqa: F403
from course.chapters.ch13.live import BoardFeed, LiveService, game_events, make_app, season_clock, sse  # noqa: F401
