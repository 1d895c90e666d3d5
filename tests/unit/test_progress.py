"""`art_nb.utils.progress`: a notebook's saved output shows a bar's final state, not its first "0%"."""

from __future__ import annotations

import pytest

from art_nb.utils import progress


def test_outside_a_notebook_it_is_tqdms_own_bar():
    from tqdm.auto import tqdm

    bar = progress.progress_bar(total=2, desc="gather", disable=True)
    assert type(bar) is tqdm


@pytest.fixture
def shown(monkeypatch):
    pytest.importorskip("ipywidgets")
    import IPython.display

    outputs: list[tuple[str, str]] = []

    class Handle:
        def update(self, data, raw=False):
            assert raw and "application/vnd.jupyter.widget-view+json" in data  # the live widget stays
            outputs.append(("update", data["text/plain"]))

    def display(data, raw=False, display_id=None):
        assert raw and display_id is True
        outputs.append(("display", data["text/plain"]))
        return Handle()

    monkeypatch.setattr(IPython.display, "display", display)
    return outputs


def test_in_a_notebook_the_saved_text_becomes_the_final_state(shown):
    bar = progress._saved_notebook_bar()(total=3, desc="eval tic-tac-toe@0")
    for _ in range(3):
        bar.update(1)
    bar.set_postfix({"reward": "0.31"}, refresh=False)
    bar.close()
    bar.close()  # closing twice updates once
    assert [kind for kind, _ in shown] == ["display", "update"]
    assert shown[0][1].startswith("eval tic-tac-toe@0:   0%")
    assert "100%" in shown[1][1] and "3/3" in shown[1][1] and "reward=0.31" in shown[1][1]


def test_a_disabled_bar_shows_nothing(shown):
    bar = progress._saved_notebook_bar()(total=3, desc=None, disable=True)
    bar.update(3)
    bar.close()
    assert shown == []
