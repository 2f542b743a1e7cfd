"""Run a notebook without a browser (nbclient), as the tests and the benchmarks do.

nbclient waits for a cell's ``execute_reply`` with one poll of the kernel's shell socket that
lasts the whole cell timeout. After a cell that opens widgets (``ipywidgets.interact``), that
poll sometimes misses the reply already sitting on the socket and returns only when the
timeout ends: the cell "takes" exactly the timeout, then succeeds (nbclient issue #312,
https://github.com/jupyter/nbclient/issues/312; seen here on chapter 01's backoff slider,
300 s in the test suite). :class:`HeadlessClient` polls in short slices instead, so a
missed wake-up costs at most :data:`SLICE` seconds and the timeout still holds.

JupyterLab's server reads the kernel's sockets in its own way (jupyter_server); nothing here
changes what a learner's JupyterLab does.
"""

from __future__ import annotations

import time
from queue import Empty

from jupyter_core.utils import run_sync
from nbclient import NotebookClient

#: The longest one poll of the shell socket waits before it looks again.
SLICE = 0.25


def _sliced(get_msg):
    async def get_msg_in_slices(timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = SLICE if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return await get_msg(timeout=min(SLICE, left))
            except Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return get_msg_in_slices


class HeadlessClient(NotebookClient):
    """:class:`nbclient.NotebookClient` whose wait for a cell's reply cannot stall (see above)."""

    async def async_start_new_kernel_client(self):
        kc = await super().async_start_new_kernel_client()
        kc.shell_channel.get_msg = _sliced(kc.shell_channel.get_msg)
        return kc

    start_new_kernel_client = run_sync(async_start_new_kernel_client)  # the base binds its own
