"""Install the hooks: the HTTP ones once per library, and only for libraries the process has
imported; the thread pool's (`hook_threads`) once.

Called whenever a scope opens, so a library imported after the first scope is hooked at the next.
The patches wrap the libraries' own methods and change nothing they send or return; a response
that is not a chat completion is not even buffered.
"""

from __future__ import annotations

import sys

__all__ = ["install", "installed"]

_done: set[str] = set()


def install() -> None:
    if "threads" not in _done:  # concurrent.futures: already imported by asyncio
        from . import hook_threads

        hook_threads.install()
        _done.add("threads")
    for name in ("httpx", "httpx2"):  # httpx2: what the openai SDK 3.x sends with
        if name in sys.modules and name not in _done:
            from . import hook_httpx

            hook_httpx.install(sys.modules[name])
            _done.add(name)
    if "requests" in sys.modules and "requests" not in _done:
        from . import hook_requests

        hook_requests.install()
        _done.add("requests")
    if "aiohttp" in sys.modules and "aiohttp" not in _done:
        from . import hook_aiohttp

        hook_aiohttp.install()
        _done.add("aiohttp")


def installed() -> set[str]:
    """The libraries hooked so far."""
    return set(_done)
