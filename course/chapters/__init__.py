"""What each chapter's notebook shows: ``course.chapters.chNN`` holds chapter NN's demos.

Measured runs, races, crash workers, demo tables and their schema, plots and widgets
that exist only to show something in chapter NN. Only that chapter's notebook, its
checks (``autograder/checks/chNN.py``) and its tests import it; a later chapter reuses
the *patterns* in ``course/<pattern>.py``, never another chapter's demos. A chapter that
outgrows one file becomes a package (``course/chapters/chNN/``).
"""
