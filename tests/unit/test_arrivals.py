"""The count of requests on their way to an engine, as the endpoint keeps it: an engine that gathers a
burst into one step waits while it is above zero, so it must come back down on every path. The endpoint's
side: tests/unit/test_server.py (test_each_request_counts_as_coming_until_the_engine_has_it)."""

from __future__ import annotations

import pytest

from art_nb.local.engines.arrivals import Arrivals, arrived


def test_a_request_counts_until_it_arrives_or_its_block_ends() -> None:
    arrivals = Arrivals()
    with arrivals.coming():
        with arrivals.coming() as second:
            assert arrivals.count == 2
            arrived()  # the innermost request of this context
            assert arrivals.count == 1
            second()  # once only
            assert arrivals.count == 1
        assert arrivals.count == 1
    assert arrivals.count == 0
    with pytest.raises(ValueError), arrivals.coming():
        raise ValueError("the request failed before it reached the engine")
    assert arrivals.count == 0
    arrived()  # outside any request: nothing to count
