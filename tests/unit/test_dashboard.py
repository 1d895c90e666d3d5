"""The dashboard's parts without a kernel: run state from events and history, figure, viewer, widget
wiring, summary, and that `art_nb.notebook` stays light to import (the parameters' defaults and the
plan behind them: test_notebook_plan.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from art_nb import events
from art_nb.notebook.state import RunState
from art_nb.notebook.viewer import conversation_html, conversation_text, list_trajectory_files

T0 = 1_000.0


def rollout_log(step: int, reward: float, lo: float, hi: float, t: float, **metrics: float) -> dict:
    return {"type": "log", "time": t, "model": "m", "step": step, "split": "train",
            "metrics": {"reward": reward, "reward_min": lo, "reward_max": hi, "reward_std": 0.1, "trajectories": 8.0,
                        "exceptions": 0.0, **metrics}}


def train_finished(new_step: int, t: float, zero: int = 1, used: int = 1) -> dict:
    return {"type": "train_finished", "time": t, "model": "m", "step": new_step, "checkpoint": f"/ckpt/{new_step:04d}",
            "metrics": {"loss": 0.25, "groups": float(used), "zero_variance_groups": float(zero), "time/pause": 0.5,
                        "time/train": 4.0, "time/save": 1.0, "time/swap": 0.5, "time/step_total": 6.0}}


def two_steps() -> RunState:
    state = RunState("m", now=T0)
    assert state.handle(rollout_log(0, -0.5, -1.0, 0.5, T0 + 10, loss=0.75, win=0.1)) == "rollouts"
    assert state.handle({"type": "train_started", "time": T0 + 10, "model": "m", "step": 0, "groups": 2}) == "training"
    assert state.training_step == 0
    assert state.handle(train_finished(1, T0 + 16)) == "train"
    assert state.handle(rollout_log(1, 0.25, -0.5, 1.0, T0 + 30, loss=0.5, win=0.4)) == "rollouts"
    assert state.handle(train_finished(2, T0 + 36, zero=0, used=2)) == "train"
    return state


def test_state_follows_the_backend_step_numbering_and_measures_rollout_time():
    state = two_steps()
    rows = state.reward_rows()
    assert [r.step for r in rows] == [0, 1]
    assert [r.reward for r in rows] == [-0.5, 0.25]
    assert (rows[0].reward_min, rows[0].reward_max) == (-1.0, 0.5)
    # Rollout time runs from the end of the previous update (or the start) to the rollouts' log event.
    assert rows[0].rollout_seconds == pytest.approx(10.0)
    assert rows[1].rollout_seconds == pytest.approx(14.0)
    assert rows[0].timings() == {"rollout": 10.0, "time/pause": 0.5, "time/train": 4.0, "time/save": 1.0,
                                 "time/swap": 0.5}
    assert (rows[0].zero_variance_groups, rows[0].total_groups) == (1, 2)  # total from train_started
    assert (rows[1].zero_variance_groups, rows[1].total_groups) == (0, 2)  # total from groups + zero-variance
    assert state.served_step == 2 and state.training_step is None
    assert state.latest_checkpoint == "/ckpt/0002"


def test_trainer_metrics_never_shadow_rollout_metrics_of_the_same_name():
    state = two_steps()
    names = state.metric_names()
    assert "loss" in names and "trainer/loss" in names  # tic-tac-toe's loss rate vs the GRPO loss
    assert not any(n.startswith("trainer/time/") for n in names)
    assert state.series("loss") == ([0, 1], [0.75, 0.5])
    assert state.series("trainer/loss") == ([0, 1], [0.25, 0.25])
    assert state.series("win") == ([0, 1], [0.1, 0.4])


def test_events_of_other_models_are_ignored_and_gather_progress_is_kept():
    state = RunState("m", now=T0)
    assert state.handle({**rollout_log(0, 1.0, 1.0, 1.0, T0), "model": "other"}) is None
    assert state.steps == {}
    assert state.handle({"type": "gather_progress", "time": T0, "desc": "step 1", "done": 3, "total": 8,
                         "reward_mean": 0.5, "exceptions": 1}) == "progress"
    assert state.progress["done"] == 3 and state.progress["exceptions"] == 1
    assert state.handle({"type": "something_else"}) is None


def test_eval_logs_become_eval_points():
    state = two_steps()
    assert state.handle({"type": "log", "time": T0 + 50, "model": "m", "step": 2, "split": "val",
                         "metrics": {"reward": 0.75, "trajectories": 4.0}}) == "eval"
    assert state.evals == {2: {"reward": 0.75, "trajectories": 4.0}}
    assert "eval at step 2: reward 0.750" in state.text()
    state.handle({"type": "log", "time": T0 + 60, "model": "m", "step": 0, "split": "val", "metrics": {"reward": -0.25}})
    assert "eval at step 0 (the base model): reward -0.250" in state.text()


def test_the_base_models_evaluation_is_the_plots_step_0_point():
    from art_nb.notebook.figures import dashboard_figure

    state = two_steps()
    for step, reward in ((2, 0.75), (0, -0.25)):  # the notebooks log the base model's games after training
        state.handle({"type": "log", "time": T0 + 50, "model": "m", "step": step, "split": "val",
                      "metrics": {"reward": reward}})
    reward_axis = dashboard_figure(state, "win", "t").axes[0]
    evals = next(line for line in reward_axis.get_lines() if line.get_label() == "eval mean")
    assert list(evals.get_xdata()) == [0.0, 2.0] and list(evals.get_ydata()) == [-0.25, 0.75]
    assert [t.get_text() for t in reward_axis.texts] == ["base model"]
    assert not dashboard_figure(two_steps(), "win", "t").axes[0].texts  # no base point, no label


def test_history_lines_load_into_the_same_state():
    history = [
        {"step": 0, "split": "train", "time": 1, "train/reward": -0.5, "train/reward_min": -1.0,
         "train/reward_max": 0.5, "train/loss": 0.75, "train/trajectories": 8},
        {"step": 0, "split": "train", "time": 2, "train/loss": 0.25, "train/zero_variance_groups": 1.0,
         "train/groups": 1.0, "train/time/train": 4.0, "train/time/step_total": 6.0},
        {"step": 1, "split": "val", "time": 3, "val/reward": 0.5},
        "not a record",
    ]
    state = RunState("m")
    state.load_history([h for h in history if isinstance(h, dict)])
    (row,) = state.reward_rows()
    assert row.reward == -0.5 and row.rollout_metrics["loss"] == 0.75  # the rollout line's loss rate
    assert row.train_metrics["loss"] == 0.25  # the update line's GRPO loss
    assert row.zero_variance_groups == 1 and state.served_step == 1
    assert state.evals == {1: {"reward": 0.5}}


def test_text_report_has_one_row_per_step():
    text = two_steps().text()
    lines = text.splitlines()
    assert lines[0].startswith("art_nb run m: 2 steps")
    assert lines[2].split()[:4] == ["0", "-0.500", "-1.000", "0.500"]
    assert "1/2" in lines[2] and "10.0s" in lines[2]


def test_figure_draws_band_metric_and_timings():
    from art_nb.notebook.figures import dashboard_figure, figure_png

    figure = dashboard_figure(two_steps(), "win", "t")
    reward_axis, metric_axis, time_axis = figure.axes
    assert len(reward_axis.collections) == 1  # the min-max band
    assert list(reward_axis.lines[0].get_ydata()) == [-0.5, 0.25]
    assert list(metric_axis.lines[0].get_ydata()) == [0.1, 0.4]
    assert metric_axis.get_title() == "win per step"
    assert len(time_axis.patches) == 2 * 5  # five parts per step, two steps
    png = figure_png(figure)
    assert png.startswith(b"\x89PNG") and len(png) > 5_000


# ---- trajectories -------------------------------------------------------------------------------

RECORD = {
    "group": 1,
    "reward": 0.5,
    "metrics": {"win": 1, "moves": 3},
    "messages": [
        {"role": "system", "content": "play"},
        {"role": "user", "content": "board <b>"},
        {"role": "assistant", "content": "<move>B2</move><script>alert(1)</script>"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "seen"}]},
    ],
}


def test_conversation_html_escapes_model_output_and_shows_reward_and_tools():
    page = conversation_html(RECORD)
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "&lt;move&gt;B2&lt;/move&gt;" in page
    assert "reward 0.500" in page and "win=1" in page and "group 1" in page
    assert "look({&quot;x&quot;: 1})" in page
    assert "seen" in page and "(c1)" in page
    text = conversation_text(RECORD)
    assert text.splitlines()[0].startswith("reward 0.500") and "[tool] seen" in text


def test_an_example_turn_in_the_prompt_is_not_shown_as_the_models_play(chatml_tokenizer):
    import art_nb as art
    from art_nb.envs import tic_tac_toe as ttt
    from art_nb.notebook import show_trajectory

    from conftest import make_choice

    played = make_choice(chatml_tokenizer, "<move>B2</move>")
    trajectory = art.Trajectory(messages_and_choices=[{"role": "system", "content": ttt.SYSTEM_PROMPT},
                                                      *ttt.EXAMPLE_TURN, {"role": "user", "content": "board"}, played])
    view = show_trajectory(trajectory)
    lines = [line for line in str(view).splitlines() if line.startswith("[assistant")]
    assert lines == ["[assistant · example written into the prompt, not played by the model] <move>C3</move>",
                     "[assistant] <move>B2</move>"]
    assert view._repr_html_().count("not played by the model") == 1
    assert "not played" not in conversation_text(RECORD)  # records without "sampled" are shown as before


def write_trajectories(model_dir: Path, split: str, step: int, rewards: list[float]) -> None:
    folder = model_dir / "trajectories" / split
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{step:04d}.jsonl", "w") as handle:
        handle.writelines(json.dumps({**RECORD, "reward": reward, "group": i}) + "\n" for i, reward in enumerate(rewards))
        handle.write('{"cut short by a cra')


def test_trajectory_files_are_listed_newest_first(tmp_path):
    write_trajectories(tmp_path, "train", 0, [0.0])
    write_trajectories(tmp_path, "train", 1, [0.0])
    write_trajectories(tmp_path, "val", 1, [0.0])
    (tmp_path / "trajectories" / "train" / "notes.txt").write_text("x")
    listed = [(split, step) for split, step, _ in list_trajectory_files(tmp_path)]
    assert listed == [("train", 1), ("val", 1), ("train", 0)]
    assert list_trajectory_files(tmp_path / "missing") == []


# ---- the widget ---------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path):
    model_dir = tmp_path / "proj" / "models" / "m"
    (model_dir / "checkpoints" / "0001").mkdir(parents=True)
    lines = [
        {"step": 0, "split": "train", "time": 1, "train/reward": -0.5, "train/reward_min": -1.0,
         "train/reward_max": 0.0, "train/win": 0.0},
        {"step": 0, "split": "train", "time": 2, "train/loss": 0.1, "train/zero_variance_groups": 0.0,
         "train/groups": 2.0, "train/time/train": 3.0, "train/time/step_total": 4.0},
    ]
    (model_dir / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    write_trajectories(model_dir, "train", 0, [-1.0, 0.0])
    return model_dir


@pytest.fixture
def dashboard(run_dir):
    pytest.importorskip("ipywidgets")
    from art_nb.notebook.dashboard import Dashboard

    board = Dashboard(model_dir=run_dir, metric="win")
    yield board
    board.close()


def test_dashboard_starts_from_the_run_files(dashboard, run_dir):
    assert dashboard.model_name == "m"
    assert [r.step for r in dashboard.state.reward_rows()] == [0]
    assert dashboard.state.latest_checkpoint == str(run_dir / "checkpoints" / "0001")
    assert "data-steps='1'" in dashboard._caption.value
    assert bytes(dashboard._plot.value).startswith(b"\x89PNG")
    assert dashboard._metric_picker.value == "win"
    # The viewer shows step 0, best reward first.
    assert dashboard._viewer.file_picker.options[0][0] == "train · step 0"
    assert dashboard._viewer.item_picker.options[0][0].startswith("#1 · reward 0.000")
    assert "reward 0.000" in dashboard._viewer.body.value


def test_dashboard_updates_from_events_and_shows_the_new_step(dashboard, run_dir):
    before = bytes(dashboard._plot.value)
    write_trajectories(run_dir, "train", 1, [1.0, 0.5])
    events.emit("log", model="m", step=1, split="train",
                metrics={"reward": 0.75, "reward_min": 0.5, "reward_max": 1.0, "win": 1.0, "exceptions": 2.0})
    assert bytes(dashboard._plot.value) != before
    assert "data-steps='2'" in dashboard._caption.value
    assert dashboard._viewer.file_picker.value.endswith("0001.jsonl")  # follows the newest step
    assert "reward 1.000" in dashboard._viewer.body.value
    events.emit("train_started", model="m", step=1, groups=2)
    assert "training on step 1" in dashboard._header.value
    events.emit("train_finished", model="m", step=2, checkpoint="/ck/0002",
                metrics={"loss": 0.2, "groups": 1.0, "zero_variance_groups": 1.0, "time/train": 2.0,
                         "time/save": 0.5, "time/pause": 0.1, "time/swap": 0.2})
    assert "zero-variance groups at step 1: <b>1/2</b>" in dashboard._facts.value
    assert "rollout exceptions: <b>2</b>" in dashboard._facts.value
    assert "/ck/0002" in dashboard._facts.value
    assert "train 2.0s" in dashboard._timing.value and "checkpoint 0.5s" in dashboard._timing.value
    events.emit("gather_progress", desc="step 3", done=4, total=4, reward_mean=0.5, exceptions=0)
    assert "step 3: 4/4" in dashboard._header.value


def test_picking_a_metric_redraws(dashboard):
    before = bytes(dashboard._plot.value)
    assert "trainer/loss" in dashboard._metric_picker.options
    dashboard._metric_picker.value = "trainer/loss"
    assert bytes(dashboard._plot.value) != before


def test_warnings_and_cell_exceptions_land_in_the_dashboard(dashboard, capsys):
    logging.getLogger("art_nb").warning("step 3: non-finite loss, update skipped")
    assert "non-finite loss" in dashboard._errors.value
    with pytest.raises(ValueError, match="bad reward"), dashboard:  # recorded, never swallowed
        raise ValueError("bad reward")
    assert "ValueError: bad reward" in dashboard._errors.value
    # The text fallback keeps an error's first line: that is the error itself, not a file and line.
    assert dashboard.state.text().splitlines()[-1] == "error: ValueError: bad reward"
    assert "(raised in test_dashboard.py, line" in dashboard.state.errors[-1]


def test_static_fallback_bundle_has_widget_text_and_png(dashboard):
    bundle = dashboard._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == dashboard.widget.model_id
    assert bundle["text/plain"].startswith("art_nb run m")
    assert bundle["image/png"]  # base64 PNG for nbconvert / GitHub


def test_closing_or_replacing_stops_listening(run_dir, dashboard):
    from art_nb.notebook.dashboard import Dashboard

    replacement = Dashboard(model_dir=run_dir)  # a re-run cell: the old one is closed
    try:
        events.emit("log", model="m", step=5, split="train", metrics={"reward": 1.0})
        assert 5 in replacement.state.steps
        assert 5 not in dashboard.state.steps
    finally:
        replacement.close()
    events.emit("log", model="m", step=6, split="train", metrics={"reward": 1.0})
    assert 6 not in replacement.state.steps


def test_summary_saves_reward_per_step(dashboard, tmp_path):
    summary = dashboard.summary(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(s["step"], s["reward"]) for s in saved["steps"]] == [(0, -0.5)]
    assert (tmp_path / "out" / "reward_curve.png").read_bytes().startswith(b"\x89PNG")
    bundle = summary._repr_mimebundle_()
    assert "| 0 | -0.500 |" in bundle["text/markdown"] and bundle["image/png"]


def test_summary_from_model_dir_needs_only_files(run_dir):
    from art_nb.notebook.summary import summary_from_model_dir

    summary = summary_from_model_dir(run_dir)
    assert summary.served_step == 1 and [s["step"] for s in summary.steps] == [0]


def test_run_files_are_read_the_store_way(run_dir):
    from art_nb.notebook.summary import load_run_files

    (run_dir / "checkpoints" / "0002.partial").mkdir()  # not a step directory: never counted (nor parsed)
    (run_dir / "checkpoints" / ".tmp-0003-1-2").mkdir()  # a write cut short by a crash
    with open(run_dir / "history.jsonl", "a") as handle:
        handle.write('{"step": 1, "split": "tr')  # a line cut short by a crash
    state = RunState("m")
    load_run_files(state, run_dir)
    assert state.served_step == 1 and state.latest_checkpoint == str(run_dir / "checkpoints" / "0001")
    assert [r.step for r in state.reward_rows()] == [0]
    empty = RunState("m")
    load_run_files(empty, run_dir.parent / "missing")
    assert empty.served_step is None and empty.reward_rows() == []


def test_the_backend_says_where_the_run_is(run_dir):
    pytest.importorskip("ipywidgets")
    import art_nb as art
    from art_nb.notebook.dashboard import Dashboard

    class Located:  # only what the dashboard asks of a backend
        def model_dir(self, model):
            assert model.name == "m"
            return run_dir

    model = art.TrainableModel(name="m", project="proj", base_model="base")
    board = Dashboard(model, Located())
    unregistered = Dashboard(art.TrainableModel(name="n", base_model="base"))  # no backend yet: no files
    try:
        assert board.model_dir == run_dir and board.state.served_step == 1
        assert unregistered.model_dir is None and unregistered.state.reward_rows() == []
        assert "model.register(backend)" in unregistered._viewer.body.value
    finally:
        board.close()
        unregistered.close()


def test_a_broken_plot_is_reported_once(dashboard, caplog, monkeypatch):
    from art_nb.notebook import figures

    def broken(*args, **kwargs):
        raise ValueError("x and y must have same first dimension")

    monkeypatch.setattr(figures, "dashboard_figure", broken)
    caplog.set_level(logging.DEBUG, logger="art_nb")
    for step in (3, 4):
        events.emit("log", model="m", step=step, split="train", metrics={"reward": 0.5})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "dashboard update failed" in r.message]
    assert len(warnings) == 1
    assert "ValueError: x and y must have same first dimension" in warnings[0].message
    assert "dashboard update failed" in dashboard._errors.value  # the view itself says so too


def test_compare_puts_runs_side_by_side():
    from art_nb import Trajectory
    from art_nb.notebook.evaluation import compare

    base = [Trajectory(messages_and_choices=[], reward=r, metrics={"win": w}) for r, w in ((0.0, 0), (1.0, 1))]
    trained = [Trajectory(messages_and_choices=[], reward=1.0, metrics={"win": 1})]
    table = compare({"base": base, "step 2": trained})
    assert table.table["base"]["reward"] == 0.5 and table.table["step 2"]["win"] == 1.0
    assert table.rows == ("reward", "win", "trajectories")
    assert "| reward | 0.500 | 1.000 |" in table._repr_markdown_()


# ---- importing ------------------------------------------------------------------------------------


def test_importing_art_nb_notebook_is_light():
    code = ("import sys, art_nb.notebook as nb; nb.pick_defaults; "
            "heavy = [m for m in ('ipywidgets', 'matplotlib', 'torch', 'transformers') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_picked_metric_survives_new_metric_names(tmp_path):
    pytest.importorskip("ipywidgets")
    from art_nb.notebook.dashboard import Dashboard

    board = Dashboard(model_dir=tmp_path / "m", metric="invalid")  # no data yet: "invalid" is not known
    try:
        assert board._metric_picker.value == "invalid"
        events.emit("log", model="m", step=0, split="train", metrics={"reward": 0.0, "draw": 0.1, "invalid": 0.5})
        assert board._metric_picker.options[0] == "draw"  # sorted names: "draw" comes first...
        assert board._metric_picker.value == "invalid" and board._metric == "invalid"  # ...the pick stays
    finally:
        board.close()


# ---- KEEP_ON_DRIVE --------------------------------------------------------------------------------


def test_keep_on_drive_is_a_no_op_off_colab(monkeypatch, capsys):
    from art_nb.notebook import colab

    monkeypatch.setattr(colab, "in_colab", lambda: False)
    assert colab.keep_on_drive(".art") == ".art"
    assert "not on Colab" in capsys.readouterr().out


def test_keep_on_drive_mounts_drive_once_and_keeps_the_run_there(monkeypatch, tmp_path):
    import types as pytypes

    from art_nb.notebook import colab

    mounted = []

    def mount(point):
        mounted.append(point)
        (Path(point) / "MyDrive").mkdir(parents=True)

    google = pytypes.ModuleType("google")
    google.colab = pytypes.ModuleType("google.colab")
    google.colab.drive = pytypes.SimpleNamespace(mount=mount)
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", google.colab)
    monkeypatch.setattr(colab, "in_colab", lambda: True)
    point = tmp_path / "content" / "drive"
    first = colab.keep_on_drive(".art", mount_point=str(point))
    assert first == str(point / "MyDrive" / "art_nb" / ".art") and Path(first).is_dir()
    assert colab.keep_on_drive("runs/.art", mount_point=str(point)) == first  # mounted already: not again
    assert mounted == [str(point)]
