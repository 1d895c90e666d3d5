"""A run's stored trajectories as a Hugging Face `datasets.Dataset`, for SFT or analysis.

    data = art.trajectories_dataset(model, best_only=True, min_reward=1.0)   # the best rollout per group
    data.to_json("sft.jsonl")  # or trl.SFTTrainer(train_dataset=data, ...): `messages` is its chat format

One row per trajectory, read from the files every backend writes (`records.trajectory_record`,
under `trajectories/{split}/{step:04d}.jsonl`), so a finished run, a run still training and a run
copied from another machine read the same. The columns, with a fixed schema (an empty result has
them too):

| column | type | what |
|---|---|---|
| `split` | str | "train", "val", ... (the `split` given to `model.log`/`train`) |
| `step` | int | the step whose file holds the trajectory (a train batch's step is the model's step before it trained) |
| `group` | int | the group's index within the batch recorded with it; with `split` and `step` it names the group |
| `reward` | float | the trajectory's reward |
| `messages` | list of messages | OpenAI chat format: `role`, `content`, `name`, `tool_call_id`, `tool_calls` (`id`, `type`, `function.name`, `function.arguments` as a JSON string); a field a message lacks is None |
| `sampled` | list of bool | per message, whether the model sampled it (False: written into the prompt, e.g. an example turn) |
| `metrics` | dict of float | the trajectory's metrics (a key another trajectory of the run has, this one not: None) |
| `metadata` | str | the trajectory's metadata as JSON text (its values may mix types, which one column cannot hold) |
| `tools` | str or None | the tool schemas offered, as JSON text |

Content given as a list of parts is kept as the concatenation of its text parts. Additional
histories (ART's `additional_histories`) are not exported.

`datasets` is imported only when called; without it the error names the extra that brings it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .store import read_jsonl, trajectory_files

if TYPE_CHECKING:
    import datasets

    from .model import Model

__all__ = ["COLUMNS", "trajectories_dataset", "trajectory_rows"]

COLUMNS = ("split", "step", "group", "reward", "messages", "sampled", "metrics", "metadata", "tools")
_MESSAGE_FIELDS = ("role", "content", "name", "tool_call_id")


def trajectories_dataset(
    source: Model | str | os.PathLike[str],
    *,
    split: str | None = "train",
    steps: Iterable[int] | None = None,
    min_reward: float | None = None,
    best_only: bool = False,
) -> datasets.Dataset:
    """The stored trajectories of a run as a `datasets.Dataset` (columns: see the module docstring).

    `source` is a registered model (its backend says where the run lives) or a model directory
    (`{path}/{project}/models/{name}`). `split=None` reads every split; `steps` keeps those steps
    only. `min_reward` keeps trajectories whose reward is at least that; `best_only` keeps the
    highest-rewarded trajectory of each group (the first on a tie), after the threshold: together they
    make a rejection-sampling SFT set. Rows are ordered by split, step, group.
    """
    rows = trajectory_rows(_model_dir(source), split=split, steps=steps, min_reward=min_reward, best_only=best_only)
    return _to_dataset(rows)


def trajectory_rows(
    model_dir: Path,
    *,
    split: str | None = "train",
    steps: Iterable[int] | None = None,
    min_reward: float | None = None,
    best_only: bool = False,
) -> list[dict[str, Any]]:
    """The rows `trajectories_dataset` builds its Dataset from, as plain dicts (no `datasets` needed)."""
    wanted = None if steps is None else {int(s) for s in steps}
    files = sorted((s, step, path) for s, step, path in trajectory_files(Path(model_dir))
                   if (split is None or s == split) and (wanted is None or step in wanted))
    rows = [_row(s, step, record) for s, step, path in files for record in read_jsonl(path)]
    if min_reward is not None:
        rows = [row for row in rows if row["reward"] >= min_reward]
    if best_only:
        best: dict[tuple[str, int, int], dict[str, Any]] = {}
        for row in rows:
            key = (row["split"], row["step"], row["group"])
            if key not in best or row["reward"] > best[key]["reward"]:
                best[key] = row
        kept = {id(row) for row in best.values()}
        rows = [row for row in rows if id(row) in kept]
    return rows


def _model_dir(source: Model | str | os.PathLike[str]) -> Path:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no model directory at {path}: give a registered model or "
                                    "{path}/{project}/models/{name}")
        return path
    return source.backend.model_dir(source)


def _row(split: str, step: int, record: dict[str, Any]) -> dict[str, Any]:
    messages = record.get("messages") or []
    sampled = record.get("sampled") or []
    tools = record.get("tools")
    return {
        "split": split,
        "step": step,
        "group": int(record.get("group", 0)),
        "reward": float(record.get("reward", 0.0)),
        "messages": [_message(m) for m in messages],
        # Records written before "sampled" existed: an assistant turn then is taken as sampled.
        "sampled": [bool(x) for x in sampled] if len(sampled) == len(messages)
        else [m.get("role") == "assistant" for m in messages],
        "metrics": {k: float(v) for k, v in (record.get("metrics") or {}).items()},
        "metadata": json.dumps(record.get("metadata") or {}, sort_keys=True),
        "tools": None if tools is None else json.dumps(tools),
    }


def _message(message: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {key: message.get(key) for key in _MESSAGE_FIELDS}
    content = out["content"]
    if content is not None and not isinstance(content, str):  # a list of parts: its text
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    calls = message.get("tool_calls")
    out["tool_calls"] = None if not calls else [
        {"id": c.get("id"), "type": c.get("type", "function"),
         "function": {"name": c.get("function", {}).get("name"), "arguments": _arguments(c.get("function", {}))}}
        for c in calls]
    return out


def _arguments(function: dict[str, Any]) -> str | None:
    arguments = function.get("arguments")
    return arguments if arguments is None or isinstance(arguments, str) else json.dumps(arguments)


def _to_dataset(rows: list[dict[str, Any]]) -> datasets.Dataset:
    try:
        import datasets
    except ImportError as error:
        raise ImportError("trajectories_dataset needs the `datasets` package: pip install 'art-nb[notebook]' "
                          "(or pip install datasets)") from error
    text = datasets.Value("string")
    message = {"role": text, "content": text, "name": text, "tool_call_id": text,
               "tool_calls": [{"id": text, "type": text, "function": {"name": text, "arguments": text}}]}
    metric_names = sorted({key for row in rows for key in row["metrics"]})
    features = datasets.Features({
        "split": text, "step": datasets.Value("int64"), "group": datasets.Value("int64"),
        "reward": datasets.Value("float64"), "messages": [message], "sampled": [datasets.Value("bool")],
        "metrics": {key: datasets.Value("float64") for key in metric_names},
        "metadata": text, "tools": text,
    })
    for row in rows:  # every row names every metric, so the struct's fields are the same in all
        row["metrics"] = {key: row["metrics"].get(key) for key in metric_names}
    return datasets.Dataset.from_dict({column: [row[column] for row in rows] for column in COLUMNS}, features=features)
