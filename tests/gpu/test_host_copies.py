"""A checkpoint's host copy on the GPU: it sees the work that made the tensors and does not wait for
the work queued after it on the device's default stream (vLLM decoding the next rollouts there)."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")


def test_host_copy_waits_for_the_tensors_but_not_for_later_default_stream_work(monkeypatch) -> None:
    from art_nb.local.engines.base import packed_copies

    tensors = {f"layer{i}": torch.zeros(1_000_000, device="cuda") for i in range(8)}
    torch.cuda._sleep(200_000_000)  # ~0.1 s, then the values the copy must see
    for tensor in tensors.values():
        tensor.add_(1)
    cycles = int(6e9)  # ~3 s at an H200's ~2 GHz
    queued_later: list[bool] = []
    wait_stream = torch.cuda.Stream.wait_stream

    def then_queue_more(self, stream):  # what vLLM's thread does right after the commit thread starts its copy
        wait_stream(self, stream)
        with torch.cuda.stream(torch.cuda.default_stream()):
            torch.cuda._sleep(cycles)
        queued_later.append(True)

    monkeypatch.setattr(torch.cuda.Stream, "wait_stream", then_queue_more)
    mark = time.perf_counter()
    copies = packed_copies(tensors, to_host=True, what="optimizer state")
    took = time.perf_counter() - mark
    monkeypatch.undo()
    still_busy = not torch.cuda.default_stream().query()
    torch.cuda.synchronize()
    assert queued_later, "the host copy did not run on a stream of its own"
    assert all(copy.device.type == "cpu" and bool((copy == 1).all()) for copy in copies.values())
    assert still_busy and took < 1.0, (took, still_busy)
