"""``python -m course.chapters.ch08 worker SPEC``: a worker of :func:`course.chapters.ch08.processes_sharing_a_limit`."""

from course.chapters.ch08 import main

main()
