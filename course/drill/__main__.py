"""``python -m course.drill``: what ``course drill`` and ``course progress`` run."""

import sys

from course.drill.terminal import main

sys.exit(main())
