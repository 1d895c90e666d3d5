"""Progress bars whose final state is what a saved notebook shows.

tqdm's notebook bar is a widget, and what a notebook saves for it (what GitHub, nbconvert and an
executed notebook show, where no widget renders) is the text it had when it was first displayed:
"0%". `progress_bar` returns tqdm.auto's bar, except in a notebook, where the bar is displayed
through a display id and its text is replaced by the final one when it closes ("24/24 [00:41<00:00,
reward=0.31]"), next to the same live widget. Nothing is patched: callers ask for this bar.

Other libraries' bars are asked off while register sends their output to its log (local/quiet.py):
in a notebook they are widgets, which no stream redirect catches, so each is turned off through its
own switch, and `library_bars()` is that switch's value for vLLM (`use_tqdm_on_load`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["library_bars", "progress_bar", "set_library_bars"]

_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_library_bars = True


def library_bars() -> bool:
    """Whether other libraries may draw their own progress bars now (not while a register is quiet)."""
    return _library_bars


def set_library_bars(on: bool) -> bool:
    """Let other libraries draw bars or not; the previous value, to put back."""
    global _library_bars
    previous, _library_bars = _library_bars, on
    return previous


def progress_bar(*args: Any, **kwargs: Any) -> Any:
    """A tqdm bar with tqdm's arguments: tqdm.auto's choice, or in a notebook one that leaves its final
    state in the saved output."""
    from tqdm.auto import tqdm
    from tqdm.autonotebook import tqdm as chosen  # tqdm.notebook's bar in a notebook with widgets

    if chosen.__module__ != "tqdm.notebook":  # a console, a script, a test: tqdm's own bar
        return tqdm(*args, **kwargs)
    return _saved_notebook_bar()(*args, **kwargs)


def _saved_notebook_bar() -> type:
    from IPython.display import display
    from tqdm.notebook import tqdm as notebook_tqdm

    class SavedNotebookBar(notebook_tqdm):  # type: ignore[misc,valid-type]
        """tqdm's notebook bar, shown through a display id whose text is updated when it closes."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["display"] = False  # shown below instead, with a display id
            super().__init__(*args, **kwargs)
            self._handle = None
            if not self.disable:
                self._handle = display(self._bundle(), raw=True, display_id=True)

        def _bundle(self) -> dict[str, Any]:
            view = {"version_major": 2, "version_minor": 0, "model_id": self.container.model_id}
            return {_WIDGET_MIME: view, "text/plain": str(self)}

        def close(self) -> None:
            done = self.disable
            super().close()
            if not done and self._handle is not None:
                self._handle.update(self._bundle(), raw=True)
                self._handle = None

    return SavedNotebookBar
