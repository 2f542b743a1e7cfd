"""nbgrader configuration for the workbook (instructors: run nbgrader from the repository root).

The repository root is the course directory: ``solutions/`` is nbgrader's source folder and
``notebooks/`` its release folder. Learners' submissions go to ``submitted/``.

Any account may load this file (a learner working in a copy, another account reading the
instructor's folder): it writes nothing, and it leaves the account's own exchange setting alone.
"""

import os
import sys

c = get_config()  # noqa: F821 - provided by traitlets when nbgrader loads this file

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _root)
from autograder import settings  # noqa: E402

settings.prepare_process()
settings.apply(c, _root)
_exchange = settings.exchange_root()
if _exchange:
    c.Exchange.root = _exchange
