"""A retrieval server follows its datastore's generations: GenerationWatch says how, and
follow_generations polls for a newer committed generation (datastore.live.LiveDatastore.refresh) while
searches go on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from memlm.retrieval.searcher import Searcher


@dataclass(frozen=True)
class GenerationWatch:
    """Follow the committed generations of the datastore served (datastore.live.LiveDatastore):
    every poll_s seconds `refresh` runs on a helper thread; it opens a newer generation while searches go
    on and then switches the searcher to it. Each searched batch and GetInfo take one `served()` snapshot,
    so every SearchResponse says the generation that answered it (a router checks it against its id
    offsets)."""

    refresh: Callable[[], bool]
    """Opens the committed generation when it is newer and switches to it; True when it switched."""
    served: Callable[[], tuple[Searcher, int]]
    """The searcher answering now and its generation, read together (LiveDatastore.served)."""
    poll_s: float = 2.0
    """Seconds between two looks at the manifest: a commit is served within about this long."""


async def follow_generations(watch: GenerationWatch, log: Callable[[str], None]) -> None:
    """Poll until cancelled (the server stopping): refresh on the loop's default executor, never on the
    search thread, so searches are not held up while a generation loads."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(watch.poll_s)
        try:
            await loop.run_in_executor(None, watch.refresh)
        except Exception as e:  # noqa: BLE001 -- a failed look must not stop the following ones
            log(f"looking for a new datastore generation failed: {type(e).__name__}: {e}")
