"""Read sample trajectories back and render them as a conversation with their reward.

The backend writes every trajectory to `{model_dir}/trajectories/{split}/{step:04d}.jsonl` before a
step trains (see `store.py`); the viewer reads those files, so it shows the same thing after a
kernel restart as during the run. Rendering is a pure function of a record (`conversation_html`),
tested without widgets; `TrajectoryViewer` is the thin ipywidgets shell around it.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..store import read_jsonl, trajectory_files

if TYPE_CHECKING:
    from ..trajectories import Trajectory

__all__ = [
    "TrajectoryView",
    "TrajectoryViewer",
    "conversation_html",
    "conversation_text",
    "list_trajectory_files",
    "read_records",
    "show_trajectory",
]

_ROLE_COLORS = {"system": "#6b7280", "user": "#2563eb", "assistant": "#059669", "tool": "#b45309",
                "developer": "#6b7280"}


def list_trajectory_files(model_dir: str | Path) -> list[tuple[str, int, Path]]:
    """(split, step, path) of every trajectories file under `model_dir`, newest step first, train first."""
    return trajectory_files(Path(model_dir))


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The trajectory records of one file, read the store's way (a line cut short by a crash is skipped)."""
    return read_jsonl(Path(path))


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(part.get("text", part)) if isinstance(part, dict) else str(part) for part in content)
    return str(content)


def _tool_calls_text(message: dict[str, Any]) -> list[str]:
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments)
        calls.append(f"→ {function.get('name', '?')}({arguments})")
    return calls


def _headline(record: dict[str, Any]) -> str:
    reward = record.get("reward")
    metrics = record.get("metrics") or {}
    shown = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in metrics.items())
    reward_text = f"{reward:.3f}" if isinstance(reward, (int, float)) else str(reward)
    return f"reward {reward_text}" + (f" · {shown}" if shown else "") + f" · group {record.get('group', '?')}"


def _role_label(record: dict[str, Any], index: int, role: str) -> str:
    """The role, and for an assistant turn the model did not generate (a worked example written into
    the prompt, kept as a dict rather than a Choice) a note saying so. `record["sampled"]`, where a
    record has it, says per message whether it was a Choice the endpoint returned."""
    sampled = record.get("sampled")
    if role == "assistant" and isinstance(sampled, list) and index < len(sampled) and not sampled[index]:
        return "assistant · example written into the prompt, not played by the model"
    return role


def conversation_text(record: dict[str, Any]) -> str:
    """The conversation as plain text (for logs and the static fallback)."""
    lines = [_headline(record)]
    for index, message in enumerate(record.get("messages") or []):
        role = _role_label(record, index, str(message.get("role", "?")))
        lines.append(f"[{role}] {_content_text(message.get('content'))}")
        lines += [f"    {call}" for call in _tool_calls_text(message)]
    return "\n".join(lines)


def conversation_html(record: dict[str, Any]) -> str:
    """The conversation as HTML: one box per message, coloured by role, reward and metrics on top.

    Everything from the trajectory is escaped: model output is untrusted text.
    """
    parts = [(f'<div class="art-nb-trajectory"><div style="font-weight:600;margin:4px 0">'
              f"{html.escape(_headline(record))}</div>")]
    for index, message in enumerate(record.get("messages") or []):
        role = str(message.get("role", "?"))
        color = _ROLE_COLORS.get(role, "#374151")
        label = _role_label(record, index, role)
        if label != role:
            color = _ROLE_COLORS["system"]  # context, not the model's play
        body = html.escape(_content_text(message.get("content")))
        calls = "".join(f"<div><code>{html.escape(c)}</code></div>" for c in _tool_calls_text(message))
        extra = f" <span style='opacity:.7'>({html.escape(str(message['tool_call_id']))})</span>" \
            if message.get("tool_call_id") else ""
        parts.append(
            f'<div style="border-left:3px solid {color};padding:2px 8px;margin:4px 0">'
            f'<div style="color:{color};font-size:85%;font-weight:600">{html.escape(label)}{extra}</div>'
            f'<pre style="white-space:pre-wrap;margin:0;font-size:90%;background:none">{body}</pre>{calls}</div>'
        )
    parts.append("</div>")
    return "".join(parts)


@dataclass(frozen=True)
class TrajectoryView:
    """One trajectory, displayable: HTML in Jupyter, text elsewhere."""

    record: dict[str, Any]

    def _repr_html_(self) -> str:
        return conversation_html(self.record)

    def __str__(self) -> str:
        return conversation_text(self.record)

    def __repr__(self) -> str:
        return str(self)


def show_trajectory(trajectory: Trajectory) -> TrajectoryView:
    """A rollout's conversation and reward, the way the dashboard shows it (for trying a rollout once).
    Assistant turns that are not Choices (a worked example in the prompt) are labelled as such; a
    rollout captured with any HTTP client shows the conversation its calls record."""
    return TrajectoryView({
        "reward": trajectory.reward,
        "metrics": dict(trajectory.metrics),
        "messages": trajectory.messages(),
        "sampled": trajectory.sampled(),
        "group": "-",
    })


class TrajectoryViewer:
    """Pick a step's file and one of its trajectories (best reward first); see the conversation.

    Follows the newest file as steps arrive until the user picks another one.
    """

    def __init__(self, model_dir: str | Path | None) -> None:
        import ipywidgets as widgets

        self.model_dir = None if model_dir is None else Path(model_dir)
        self._files: list[tuple[str, int, Path]] = []
        self._records: list[dict[str, Any]] = []
        self._follow = True
        self._updating = False
        self.file_picker = widgets.Dropdown(options=[], description="rollouts", layout=widgets.Layout(width="230px"))
        self.item_picker = widgets.Dropdown(options=[], description="trajectory",
                                            layout=widgets.Layout(width="420px"))
        # Conversations can be long: scroll inside the viewer instead of stretching the dashboard.
        self.body = widgets.HTML(value=self._empty_message(),
                                 layout=widgets.Layout(max_height="380px", overflow="auto"))
        self.body.add_class("art-nb-trajectory-view")
        self.file_picker.observe(self._on_file, names="value")
        self.item_picker.observe(self._on_item, names="value")
        self.widget = widgets.VBox([widgets.HBox([self.file_picker, self.item_picker]), self.body])

    def _empty_message(self) -> str:
        if self.model_dir is None:
            return ("<i>No run directory to read trajectories from: create the dashboard after "
                    "<code>await model.register(backend)</code>, or pass <code>model_dir=</code>.</i>")
        return "<i>No trajectories yet: they appear when the first step's rollouts are logged.</i>"

    def refresh(self) -> None:
        """Re-list the files; jump to the newest one while following."""
        if self.model_dir is None:
            return
        files = list_trajectory_files(self.model_dir)
        if files == self._files:
            return
        self._files = files
        paths = [str(path) for _, _, path in files]
        current = self.file_picker.value
        self._updating = True
        try:
            self.file_picker.options = [(f"{split} · step {step}", str(path)) for split, step, path in files]
            keep = not self._follow and current in paths
            self.file_picker.value = current if keep else (paths[0] if paths else None)
        finally:
            self._updating = False
        self._load(self.file_picker.value)

    def _on_file(self, change: dict[str, Any]) -> None:
        if self._updating:
            return
        newest = str(self._files[0][2]) if self._files else None
        self._follow = change["new"] == newest
        self._load(change["new"])

    def _load(self, path: str | None) -> None:
        if path is None or not Path(path).is_file():
            self._records = []
            self.item_picker.options = []
            self.body.value = self._empty_message()
            return
        records = read_records(path)
        order = sorted(range(len(records)), key=lambda i: -_reward(records[i]))
        self._records = records
        self._updating = True
        try:
            self.item_picker.options = [
                (f"#{i} · reward {_reward(records[i]):.3f} · group {records[i].get('group', '?')}", i) for i in order
            ]
            self.item_picker.value = order[0] if order else None
        finally:
            self._updating = False
        self._show(self.item_picker.value)

    def _on_item(self, change: dict[str, Any]) -> None:
        if not self._updating:
            self._show(change["new"])

    def _show(self, index: int | None) -> None:
        if index is None or index >= len(self._records):
            self.body.value = "<i>This file holds no trajectories.</i>"
            return
        self.body.value = conversation_html(self._records[index])


def _reward(record: dict[str, Any]) -> float:
    reward = record.get("reward")
    return float(reward) if isinstance(reward, (int, float)) else float("nan")
