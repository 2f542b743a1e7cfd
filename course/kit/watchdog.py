"""Stops a run's embedded servers when their owner dies without cleaning up (even SIGKILL).

python -m course.kit.watchdog '{"pid": OWNER_PID, "started": START_TIME}' RUN_DIR
"""

import json
import sys
import time
from pathlib import Path


def main() -> None:
    from course.kit import procs

    owner, run = json.loads(sys.argv[1]), Path(sys.argv[2])
    while run.exists():
        if not procs.alive(owner):  # gone, or its pid now belongs to another process
            from course.kit.backends import stop_embedded

            stop_embedded(run)
            return
        time.sleep(0.5)


if __name__ == "__main__":
    main()
