"""Chapter 11's demos: counting and fan-out, measured live.

Only chapter 11's notebook, checks and tests import this package. The patterns live in
:mod:`course.counters` and :mod:`course.chat`; here are the rig the checks use
(:mod:`.rig`), the measured runs and the plots (:mod:`.counting`, :mod:`.flushes`, :mod:`.feeds`,
:mod:`.notify`, :mod:`.chatting`), and the crash worker killed with SIGKILL (:mod:`.worker`).
"""
