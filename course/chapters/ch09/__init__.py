"""Chapter 09 (data access: pagination, ids, consistency, sharding): its demos. Only chapter 09 imports this.

The notebook calls ``ch09.<name>``: pagination demos (:mod:`.pages`), the id benchmark
(:mod:`.ids`), the streaming replicas (:mod:`.replica`) and the sharding demos (:mod:`.hashing`).
"""

from course.chapters.ch09 import hashing, ids, replica  # noqa: F401
from course.chapters.ch09.pages import *  # noqa: F403
