"""Chapter 13 (the live leaderboard): its demos and its live page. Only chapter 13 imports this.

The notebook calls ``ch13.<name>`` for both: the demos (:mod:`.demos`) and the page (:mod:`.live`).
"""

from course.chapters.ch13.demos import *  # noqa: F403
from course.chapters.ch13.live import BoardFeed, LiveService, make_app, season_clock, sse  # noqa: F401
