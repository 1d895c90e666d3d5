"""How an export is shown in a notebook: paths, a download link, and on Colab the browser download itself.

`art_nb.local.export` only writes files; this module is the presenter for the notebook's last cell.
"""

from __future__ import annotations

import html
import os
from dataclasses import dataclass
from pathlib import Path

from ..types import ExportResult
from .colab import in_colab

__all__ = ["ExportView", "show_export"]


@dataclass(frozen=True)
class ExportView:
    """Shows as links in Jupyter (relative to the notebook's directory) and as text elsewhere."""

    result: ExportResult
    downloading: bool = False

    def _link(self, path: Path | None, label: str) -> str:
        if path is None:
            return ""
        try:
            relative = os.path.relpath(path, Path.cwd())
        except ValueError:  # another drive on Windows
            relative = str(path)
        target = relative if not relative.startswith("..") else str(path)
        # Jupyter serves files under its root at files/<path>; a relative href resolves against the notebook.
        href = html.escape(target.replace(os.sep, "/"), quote=True)
        return f"<li>{label}: <a href='{href}' download target='_blank'><code>{html.escape(str(path))}</code></a></li>"

    def _repr_html_(self) -> str:
        r = self.result
        items = [
            self._link(r.zip_path, "adapter zip (download)"),
            f"<li>PEFT adapter directory: <code>{html.escape(str(r.adapter_dir))}</code></li>",
        ]
        if r.merged_dir is not None:
            items.append(f"<li>merged 16-bit model: <code>{html.escape(str(r.merged_dir))}</code></li>")
        if r.gguf_path is not None:
            items.append(self._link(r.gguf_path, "GGUF for llama.cpp / Ollama (download)"))
        if r.hub_url:
            items.append(f"<li>Hugging Face Hub: <a href='{html.escape(r.hub_url, quote=True)}' target='_blank'>"
                         f"{html.escape(r.hub_url)}</a></li>")
        items += [f"<li style='opacity:.8'>{html.escape(note)}</li>" for note in r.notes]
        if self.downloading:
            items.append("<li>the browser download of the zip has started (Colab)</li>")
        return f"<b>Exported step {r.step}</b><ul>{''.join(i for i in items if i)}</ul>"

    def __str__(self) -> str:
        return str(self.result) + ("\n  the browser download of the zip has started (Colab)" if self.downloading else "")

    def __repr__(self) -> str:
        return str(self)


def show_export(result: ExportResult, download: bool = True) -> ExportView:
    """A displayable view of `result`; on Colab with `download`, also starts the zip's browser download."""
    downloading = False
    if download and result.zip_path is not None and in_colab():
        try:
            from google.colab import files  # type: ignore[import-not-found]

            files.download(str(result.zip_path))
            downloading = True
        except Exception:  # noqa: BLE001 - a blocked download still leaves the file and its path shown
            downloading = False
    return ExportView(result, downloading)
