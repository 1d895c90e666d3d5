"""W&B and trackio reporting: ART's `report_metrics` rule, one run per model, metrics per step, resumed.

The W&B test records a real run in offline mode (`WANDB_MODE=offline`) and reads it back from the
run's own `.wandb` file, so what would be synced is what is asserted on. trackio is faked (it is not
on the machine's package index); its calls are what trackio's API documents.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import types
from pathlib import Path

import pytest

from art_nb import events, reporting
from art_nb.secrets import MissingSecretError

FAKE_KEY = "wandb-key-0123456789abcdef0123456789abcdef"


class FakeBackend:
    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir

    def model_dir(self, model) -> Path:
        return self.dir


def model(name: str = "tic-tac-toe"):
    return types.SimpleNamespace(name=name, project="notebooks", trainable=True, base_model="tiny/model")


@pytest.fixture(autouse=True)
def no_key(monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    yield
    for reporter in list(reporting._ACTIVE.values()):
        reporter.close()


# ---- which targets ---------------------------------------------------------------------------------


def test_none_means_wandb_only_when_a_key_is_found(monkeypatch):
    assert reporting.resolve_targets(None) == ([], None)
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    targets, key = reporting.resolve_targets(None)
    assert targets == ["wandb"] and key is not None and FAKE_KEY not in repr(key)
    assert reporting.resolve_targets([])[0] == []


def test_targets_are_checked_by_name():
    with pytest.raises(TypeError, match=r"a list, e.g. \['wandb'\]"):
        reporting.resolve_targets("wandb")
    with pytest.raises(ValueError, match="'wandb', 'trackio'"):
        reporting.resolve_targets(["tensorboard"])
    assert reporting.resolve_targets(["trackio", "trackio"])[0] == ["trackio"]


def test_wandb_asked_for_without_a_key_says_where_to_put_one(monkeypatch):
    with pytest.raises(MissingSecretError, match="needs a W&B key: add a Colab secret named WANDB_API_KEY.*WANDB_MODE=offline"):
        reporting.resolve_targets(["wandb"])
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert reporting.resolve_targets(["wandb"]) == (["wandb"], None)


def test_nothing_to_report_subscribes_to_nothing(tmp_path):
    reporter = reporting.start(model(), FakeBackend(tmp_path), [])
    assert reporter.targets == [] and not (tmp_path / reporting.RUN_ID_FILE).exists()


# ---- W&B, offline, read back from the run's file -----------------------------------------------------


def wandb_records(path: Path) -> list:
    """The protobuf records of a `.wandb` file (LevelDB-style log: 32 KiB blocks, 7-byte chunk headers)."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, records = path.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # the block's tail is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def offline_runs(model_dir: Path) -> list[dict]:
    """Per offline run directory, oldest first: its run id and its history rows."""
    runs = []
    for path in sorted((model_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run_id, rows = None, []
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_id = record.run.run_id
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
        runs.append({"id": run_id, "rows": rows, "dir": path.parent})
    return runs


def settled_runs(model_dir: Path, expected: int, done=lambda runs: True, timeout: float = 20.0) -> list[dict]:
    """`offline_runs` once `expected` runs are there and `done(runs)` holds: W&B's service may still be
    writing the file for a moment after `finish()` returns."""
    deadline = time.monotonic() + timeout
    while True:
        runs = offline_runs(model_dir)
        if (len(runs) == expected and done(runs)) or time.monotonic() > deadline:
            return runs
        time.sleep(0.1)


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {int(row["training_step"]): row[key] for row in rows if key in row}


def test_wandb_offline_run_per_model_with_metrics_per_step_resumed_after_a_restart(monkeypatch, tmp_path, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)  # found, handed to W&B's settings, never written or printed
    run_dir, other_dir = tmp_path / "tic-tac-toe", tmp_path / "other"
    run_dir.mkdir()
    other_dir.mkdir()

    reporter = reporting.start(model(), FakeBackend(run_dir), None)  # None + a key: W&B
    assert reporter.targets == ["wandb"]
    assert reporting.start(model(), FakeBackend(run_dir), None) is reporter  # registering again: the same run
    other = reporting.start(model("other"), FakeBackend(other_dir), ["wandb"])
    for step in range(2):
        events.emit("log", model="tic-tac-toe", step=step, split="train",
                    metrics={"reward": 0.1 * step, "invalid": 0.5, "note": "text is not plotted"})
        events.emit("train_finished", model="tic-tac-toe", step=step + 1, metrics={"loss": 0.01 * step, "time/train": 2.0})
    events.emit("log", model="other", step=0, split="train", metrics={"reward": -1.0})
    events.emit("log", model="tic-tac-toe", step=2, split="val", metrics={"reward": 0.6})
    events.emit("log", model="tic-tac-toe", step=0, split="val", metrics={"reward": -0.5})  # the base model, late
    reporter.close()
    other.close()

    run_id = (run_dir / reporting.RUN_ID_FILE).read_text().strip()
    resumed = reporting.start(model(), FakeBackend(run_dir), None)  # a new kernel: same directory, same run
    events.emit("log", model="tic-tac-toe", step=2, split="train", metrics={"reward": 0.4})
    resumed.close()

    first, second = settled_runs(run_dir, 2, lambda runs: 0 in by_step(runs[0]["rows"], "val/reward")
                                 and by_step(runs[1]["rows"], "train/reward"))
    assert first["id"] == second["id"] == run_id  # one W&B run for the model, continued after the restart
    assert settled_runs(other_dir, 1)[0]["id"] != run_id  # one run per model
    assert by_step(first["rows"], "train/reward") == {0: 0.0, 1: 0.1}
    assert by_step(first["rows"], "train/invalid") == {0: 0.5, 1: 0.5}
    assert by_step(first["rows"], "trainer/loss") == {0: 0.0, 1: 0.01}  # the update from step s's rollouts, at s
    assert by_step(first["rows"], "val/reward") == {2: 0.6, 0: -0.5}
    assert not any("train/note" in row for row in first["rows"])
    assert not any(row.get("train/reward") == -1.0 for row in first["rows"])  # the other model's event
    assert by_step(second["rows"], "train/reward") == {2: 0.4}
    assert not list(run_dir.rglob("*.table.json"))  # no trajectory text unless asked

    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not [p for p in written if FAKE_KEY.encode() in p.read_bytes()]
    out = capsys.readouterr()
    assert FAKE_KEY not in out.out + out.err


def test_trajectory_text_goes_to_wandb_only_when_asked(monkeypatch, tmp_path):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "trajectories" / "train").mkdir(parents=True)
    record = {"group": 0, "reward": 1.0, "messages": [{"role": "user", "content": "private scenario"},
                                                     {"role": "assistant", "content": "<move>B2</move>"}]}
    (tmp_path / "trajectories" / "train" / "0000.jsonl").write_text(json.dumps(record) + "\n")
    reporter = reporting.start(model(), FakeBackend(tmp_path), ["wandb"], trajectories=True)
    events.emit("log", model="tic-tac-toe", step=0, split="train", metrics={"reward": 1.0})
    events.emit("log", model="tic-tac-toe", step=0, split="train", metrics={"reward": 1.0})  # nothing new: no table
    reporter.close()
    def table_rows(rows):
        return [row for row in rows if row.get("train/trajectories/_type") == "table-file"]

    (run,) = settled_runs(tmp_path, 1, lambda runs: len([r for r in runs[0]["rows"] if "train/reward" in r]) == 2)
    tables = table_rows(run["rows"])
    assert len(tables) == 1 and tables[0]["train/trajectories/nrows"] == 1 and tables[0]["training_step"] == 0
    table = json.loads(next(run["dir"].rglob("*.table.json")).read_text())
    assert table["columns"] == ["group", "reward", "messages"]
    assert "private scenario" in table["data"][0][2]


# ---- trackio (faked) and failure handling -------------------------------------------------------------


class FakeTrackio(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("trackio")
        self.inits: list[dict] = []
        self.logged: list[tuple[dict, int]] = []
        self.finished = 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        module = self
        return types.SimpleNamespace(log=lambda row, step: module.logged.append((row, step)),
                                     finish=lambda: setattr(module, "finished", module.finished + 1))


def test_trackio_gets_the_same_rows_resuming_by_name(monkeypatch, tmp_path):
    fake = FakeTrackio()
    monkeypatch.setitem(sys.modules, "trackio", fake)
    reporter = reporting.start(model(), FakeBackend(tmp_path), ["trackio"])
    events.emit("log", model="tic-tac-toe", step=3, split="train", metrics={"reward": 0.25})
    events.emit("train_finished", model="tic-tac-toe", step=4, metrics={"loss": 0.5})
    events.emit("gather_progress", model="tic-tac-toe", done=1, total=2)
    reporter.close()
    (init,) = fake.inits
    assert (init["project"], init["name"], init["resume"]) == ("notebooks", "tic-tac-toe", "allow")
    assert init["config"]["base_model"] == "tiny/model"
    assert fake.logged == [({"train/reward": 0.25}, 3), ({"trainer/loss": 0.5}, 3)]
    assert fake.finished == 1


def test_a_failing_sink_never_reaches_training(monkeypatch, tmp_path, caplog):
    fake = FakeTrackio()
    monkeypatch.setitem(sys.modules, "trackio", fake)
    reporter = reporting.start(model(), FakeBackend(tmp_path), ["trackio"])

    def broken(row, step):
        raise ConnectionError("offline")

    reporter.sinks["trackio"].run.log = broken
    events.emit("log", model="tic-tac-toe", step=0, split="train", metrics={"reward": 0.0})  # does not raise
    assert "reporting step 0 to trackio failed: ConnectionError" in caplog.text
    replaced = reporting.start(model(), FakeBackend(tmp_path), [])
    assert replaced is not reporter and fake.finished == 1  # other targets: the old reporter ended


class RegisteringBackend(FakeBackend):
    """The bits of the Backend protocol `TrainableModel.register` calls."""

    async def register(self, model) -> None:
        pass

    def in_process_http_client(self, model: object) -> None:  # the protocol's: no in-process endpoint here
        return None

    def inference_endpoint(self, model):
        from art_nb.types import InferenceEndpoint

        return InferenceEndpoint(base_url="http://127.0.0.1:9/v1", api_key="k")

    def inference_model_name(self, model, step=None) -> str:
        return f"{model.name}@0"


async def test_registering_a_model_starts_its_reporter(monkeypatch, tmp_path):
    """`TrainableModel(report_metrics=...)` as in ART: register starts the reporter, once per model."""
    import art_nb as art

    monkeypatch.setenv("WANDB_MODE", "offline")
    backend = RegisteringBackend(tmp_path / "run")
    trained = art.TrainableModel(name="m", project="p", base_model="tiny/model", report_metrics=["wandb"])
    await trained.register(backend)
    reporter = trained._reporter
    assert reporter is not None and set(reporter.sinks) == {"wandb"}
    await trained.register(backend)  # a re-run cell keeps the same run
    assert trained._reporter is reporter
    quiet = art.TrainableModel(name="q", project="p", base_model="tiny/model")  # None and no key: nothing
    await quiet.register(RegisteringBackend(tmp_path / "quiet"))
    assert not quiet._reporter.sinks


def test_a_key_without_the_wandb_package_reports_nowhere_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    real_find_spec = reporting.importlib.util.find_spec
    monkeypatch.setattr(reporting.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    assert reporting.resolve_targets(None)[0] == []
    assert "pip install wandb" in caplog.text and FAKE_KEY not in caplog.text
