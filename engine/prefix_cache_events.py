"""The prefix cache's part of the engine's front door, beside `engine.loop.EngineLoop`'s methods:
listen to blocks becoming reusable or evicted, and drop the cache. Each runs on the engine thread
between steps, as the loop's own methods do. (The smg KV-event stream, services/smg, uses them.)"""

from __future__ import annotations

from engine.kv_cache import KVEventListener
from engine.loop import EngineLoop


def add_kv_listener(loop: EngineLoop, listener: KVEventListener) -> None:
    """From now on the KV manager tells `listener` (on the engine thread) about stored and evicted blocks."""
    loop.call(lambda core: core.kv.listeners.append(listener))


def reset_prefix_cache(loop: EngineLoop) -> None:
    """Forget every cached block no request holds (requests in flight keep theirs; evictions are announced)."""
    loop.call(lambda core: core.kv.reset_prefix_cache())
