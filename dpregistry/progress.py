"""Progress of long work inside a stage (a held-out evaluation over many batches), and one-line
messages a stage has for the user.

A stage wraps its loop in :func:`track`; whoever runs the training decides how it shows: the
CLI draws a bar under the run's, a notebook a widget, a library caller nothing at all. The
default shows nothing, so stages never print by themselves.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, TypeVar

T = TypeVar("T")

#: (iterable, total, description) -> iterable; set with :func:`showing`
_tracker: Callable[[Iterable, int | None, str], Iterable] | None = None


def track(items: Iterable[T], total: int | None = None, description: str = "") -> Iterator[T]:
    """Iterate ``items``, showing progress if the caller of the run asked for it."""
    yield from (items if _tracker is None else _tracker(items, total, description))


@contextmanager
def showing(tracker: Callable[[Iterable, int | None, str], Iterable] | None):
    """Within the block, :func:`track` reports through ``tracker`` (None: silently)."""
    global _tracker
    before, _tracker = _tracker, tracker
    try:
        yield
    finally:
        _tracker = before


#: message -> None; set with :func:`saying`
_sayer: Callable[[str], None] | None = None


def say(message: str) -> None:
    """A one-line message for whoever runs the training (what a stage resolved that the user should
    see before step 1, such as which label each label description stands for). Like :func:`track`,
    it shows only if the caller of the run asked: ``dpreg run`` and ``dpregistry.train(verbose=True)``
    print it."""
    if _sayer is not None:
        _sayer(message)


@contextmanager
def saying(sayer: Callable[[str], None] | None):
    """Within the block, :func:`say` reports through ``sayer`` (None: silently)."""
    global _sayer
    before, _sayer = _sayer, sayer
    try:
        yield
    finally:
        _sayer = before
