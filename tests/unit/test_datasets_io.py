"""Hugging Face `datasets` in and out: a run's stored trajectories as a Dataset (rows, columns, filters),
and `iterate_dataset` over a Dataset giving the batches a list gives."""

from __future__ import annotations

import json
import sys

import pytest
from openai.types.chat.chat_completion import Choice

import art_nb as art
from art_nb.datasets_io import COLUMNS, trajectories_dataset
from art_nb.records import record_groups
from art_nb.store import ModelStore

datasets = pytest.importorskip("datasets")

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def choice(content: str | None, tool_calls: list | None = None) -> Choice:
    """A Choice as the endpoint returns it (token ids and logprobs left out: the records do not keep them)."""
    return Choice.model_validate({"index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
                                  "message": {"role": "assistant", "content": content, "tool_calls": tool_calls}})


def tool_trajectory(reward: float, answer: str) -> art.Trajectory:
    """A two-turn tool-calling rollout as the endpoint makes it: a sampled tool call, its result, a sampled answer."""
    return art.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "Use the tool."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "<example>"},  # written into the prompt, not sampled
            choice(None, tool_calls=[CALL]),
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
            choice(answer),
        ],
        tools=TOOLS, reward=reward, metrics={"correct": reward > 0.5, "turns": 2}, metadata={"city": "Paris", "n": 1},
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run written through the recorder every backend uses: two train steps and one val split."""
    store = ModelStore(tmp_path_factory.mktemp("run"), "proj", "tools")
    for step in (0, 1):
        groups = [art.TrajectoryGroup([tool_trajectory(r, f"{r}#{i}") for i, r in enumerate(rewards)])
                  for rewards in ([0.0, 1.0, 1.0], [0.2, 0.4, 0.3])]
        record_groups(store, "tools", "train", step, groups, skip_recorded=False)
    plain = art.Trajectory(messages_and_choices=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                           reward=0.5, metrics={"other": 3})
    record_groups(store, "tools", "val", 2, [art.TrajectoryGroup([plain])])
    return store.dir


def test_a_stored_run_round_trips_into_a_dataset(run_dir):
    data = trajectories_dataset(run_dir)
    assert isinstance(data, datasets.Dataset) and data.column_names == list(COLUMNS)
    assert len(data) == 12 and set(data["split"]) == {"train"}
    assert data["step"] == [0] * 6 + [1] * 6 and data["group"] == [0, 0, 0, 1, 1, 1] * 2
    assert data["reward"][:6] == [0.0, 1.0, 1.0, 0.2, 0.4, 0.3]
    row = data[1]
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["system", "user", "assistant", "assistant", "tool", "assistant"]
    assert row["sampled"] == [False, False, False, True, False, True]
    call = row["messages"][3]["tool_calls"][0]
    assert call == CALL and json.loads(call["function"]["arguments"]) == {"city": "Paris"}  # OpenAI's JSON string
    assert row["messages"][4]["tool_call_id"] == "call_1" and row["messages"][5]["content"] == "1.0#1"
    assert row["messages"][0]["tool_calls"] is None and row["messages"][0]["name"] is None
    assert row["metrics"] == {"correct": 1.0, "turns": 2.0}
    assert json.loads(row["metadata"]) == {"city": "Paris", "n": 1} and json.loads(row["tools"]) == TOOLS


def test_filters_steps_splits_threshold_and_best_of_each_group(run_dir):
    assert trajectories_dataset(run_dir, steps=[1])["step"] == [1] * 6
    assert len(trajectories_dataset(run_dir, steps=[7])) == 0
    assert trajectories_dataset(run_dir, min_reward=0.4)["reward"] == [1.0, 1.0, 0.4] * 2
    best = trajectories_dataset(run_dir, best_only=True)
    assert best["reward"] == [1.0, 0.4, 1.0, 0.4]  # the first of two equal bests
    assert best["group"] == [0, 1, 0, 1] and best[0]["messages"][5]["content"] == "1.0#1"
    assert trajectories_dataset(run_dir, best_only=True, min_reward=0.5)["reward"] == [1.0, 1.0]
    everything = trajectories_dataset(run_dir, split=None)
    assert len(everything) == 13 and everything["split"][-1] == "val"
    val = everything[-1]
    assert val["messages"][0]["content"] == "hi" and val["sampled"] == [False]
    # One struct for the run's metrics: a name this row lacks reads None.
    assert val["metrics"] == {"correct": None, "other": 3.0, "turns": None}


def test_an_empty_selection_keeps_the_schema_and_a_registered_model_is_read_through_its_backend(run_dir):
    empty = trajectories_dataset(run_dir, split="nope")
    assert len(empty) == 0 and empty.column_names == list(COLUMNS)

    class Backend:
        def model_dir(self, model):
            return run_dir

    model = art.Model(name="tools", project="proj")
    model._backend = Backend()
    assert len(trajectories_dataset(model)) == 12
    with pytest.raises(FileNotFoundError, match="no model directory"):
        trajectories_dataset(run_dir / "missing")


def test_without_datasets_the_error_names_the_extra(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"art-nb\[notebook\]"):
        trajectories_dataset(run_dir)


def test_iterate_dataset_over_a_dataset_gives_the_lists_batches_and_resumes():
    rows = [{"a": i, "b": 2 * i} for i in range(11)]
    data = datasets.Dataset.from_list(rows)
    for kwargs in ({"num_epochs": 2}, {"num_epochs": 3, "initial_step": 5}, {"num_epochs": 1, "shuffle": False},
                   {"num_epochs": 2, "seed": 9}):
        ours = [(b.step, b.epoch, b.epoch_step, b.items)
                for b in art.iterate_dataset(data, groups_per_step=3, use_tqdm=False, **kwargs)]
        listed = [(b.step, b.epoch, b.epoch_step, b.items)
                  for b in art.iterate_dataset(rows, groups_per_step=3, use_tqdm=False, **kwargs)]
        assert ours == listed and ours
    assert [b.step for b in art.iterate_dataset(data, 3, 3, initial_step=5, use_tqdm=False)] == list(range(5, 12))


class CountingRows:
    """A dataset that records which rows were read: iterate_dataset must not copy it up front."""

    def __init__(self, n: int) -> None:
        self.n, self.read = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.read.append(index)
        return index


def test_iterate_dataset_reads_only_the_rows_of_the_batches_it_yields():
    rows = CountingRows(1000)
    batches = art.iterate_dataset(rows, groups_per_step=4, num_epochs=2, initial_step=300, use_tqdm=False)
    first = next(batches)
    assert first.step == 300 and sorted(rows.read) == sorted(first.items) and len(rows.read) == 4


def test_iterate_dataset_says_how_to_fix_a_dict_of_splits_or_a_stream():
    splits = datasets.Dataset.from_list([{"a": 1}, {"a": 2}]).train_test_split(test_size=1, seed=0)
    with pytest.raises(TypeError, match=r"dataset\['train'\]"):
        next(art.iterate_dataset(splits, use_tqdm=False))
    with pytest.raises(TypeError, match="no len"):
        next(art.iterate_dataset((i for i in range(3)), use_tqdm=False))


def test_the_shipped_scenarios_file_is_the_one_the_notebook_writes_where_it_is_missing(tmp_path, monkeypatch):
    """Colab opens the notebook without `notebooks/data/`: its fallback must write the same scenarios."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "notebooks"
    notebook = json.loads((root / "custom_rollout.ipynb").read_text(encoding="utf-8"))
    rollout_cell = next("".join(c["source"]) for c in notebook["cells"] if "YOUR ROLLOUT" in "".join(c["source"]))
    namespace: dict = {}
    exec(rollout_cell.split("\nSYSTEM =")[0], namespace)  # imports, SCENARIOS_FILE, make_scenarios
    monkeypatch.chdir(tmp_path)
    scenarios = namespace["make_scenarios"]()
    shipped = (root / "data" / "addition_scenarios.jsonl").read_text()
    assert (tmp_path / "data" / "addition_scenarios.jsonl").read_text() == shipped
    assert len(scenarios) == 100 and scenarios.column_names == ["a", "b"]
    assert {(r["a"], r["b"]) for r in scenarios} == {(a, b) for a in range(10) for b in range(10)}
