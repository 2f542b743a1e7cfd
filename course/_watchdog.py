"""Stops a run's embedded servers when their owner dies without cleaning up (even SIGKILL)."""

import os
import sys
import time
from pathlib import Path


def main() -> None:
    owner, run = int(sys.argv[1]), Path(sys.argv[2])
    while run.exists():
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            from course.backends import stop_embedded

            stop_embedded(run)
            return
        except PermissionError:
            pass
        time.sleep(0.5)


if __name__ == "__main__":
    main()
