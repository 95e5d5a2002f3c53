"""Progress on stderr for the waits a user sees (tqdm): a conversion, an emulator build, a
bench row, the first plan of a model, a long prefill. Off when stderr is not a terminal (logs
and pipes get no bar characters) or when the caller says so (``progress=False``)."""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

DELAY_S = 2.0  # a wait shorter than this draws nothing (tests set it to 0)


def on(enabled: bool = True) -> bool:
    """Whether to draw: asked for, and stderr is a terminal."""
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(enabled and isatty is not None and isatty())


def progress_bar(*, total: float | None, desc: str, unit: str = "it", unit_scale: bool = False,
                 enabled: bool = True, delay: float = 0.0, bar_format: str | None = None):
    """A tqdm bar on stderr (a disabled one, which costs nothing, when :func:`on` says no).
    ``delay``: seconds before it first shows, so quick work draws nothing."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=sys.stderr,
                disable=not on(enabled), delay=delay, leave=False,
                bar_format=bar_format)


@contextmanager
def ticking(bar, every_s: float = 0.5) -> Iterator[None]:
    """Redraw ``bar`` every ``every_s`` while the block runs, so its clock moves during one
    long step (tqdm redraws only on an update). Nothing for a disabled bar."""
    if bar.disable:
        yield
        return
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(every_s):
            if time.time() >= bar.start_t + bar.delay:  # tqdm's own delay rule
                bar.refresh()

    t = threading.Thread(target=tick, name="monokernel-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@contextmanager
def waiting(desc: str, *, enabled: bool = True, delay: float | None = None) -> Iterator[None]:
    """For a wait with nothing to count (a compile, one long call): after ``delay`` seconds
    (default :data:`DELAY_S`), a line on stderr with ``desc`` and the time so far, kept fresh
    until the block ends, then cleared."""
    with progress_bar(total=None, desc=desc, enabled=enabled,
                      delay=DELAY_S if delay is None else delay,
                      bar_format="{desc}: {elapsed}") as bar, ticking(bar):
        yield
