"""nbgrader configuration for the workbook (instructors: run nbgrader from the repository root).

The repository root is the course directory: ``solutions/`` is nbgrader's source folder and
``notebooks/`` its release folder. Learners' submissions go to ``submitted/``.
"""

import os
import sys

c = get_config()  # noqa: F821 - provided by traitlets when nbgrader loads this file

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _root)
from autograder import settings  # noqa: E402

settings.apply(c, _root)
c.Exchange.root = os.environ.get("NBGRADER_EXCHANGE", os.path.join(_root, ".exchange"))
os.makedirs(c.Exchange.root, exist_ok=True)
