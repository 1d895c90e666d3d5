import json
import os
import signal
import subprocess
import sys

import pytest

from art_nb.nofollow import StorePathError, open_servable, servable_files
from art_nb.store import CheckpointError, ModelStore, StoreLockedError, check_name


def write_files(directory):
    (directory / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (directory / "adapter_config.json").write_text("{}")


def test_layout_and_latest(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    assert store.latest_step() is None
    store.write_checkpoint(0, write_files)
    store.write_checkpoint(1, write_files)
    assert store.steps() == [0, 1] and store.latest_step() == 1
    assert (tmp_path / "proj/models/m1/checkpoints/0001/adapter_model.safetensors").exists()
    assert json.loads((store.checkpoint_dir(1) / "meta.json").read_text())["step"] == 1


def test_crash_mid_write_leaves_previous_latest_intact(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    store.write_checkpoint(0, write_files)

    def crash(directory):
        (directory / "adapter_model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # the user interrupts mid-save

    with pytest.raises(KeyboardInterrupt):
        store.write_checkpoint(1, crash)
    assert store.steps() == [0]
    assert not [p for p in store.checkpoints.iterdir() if p.name.startswith(".tmp")]


def test_disk_error_is_a_clear_checkpoint_error(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    store.write_checkpoint(0, write_files)

    def disk_full(directory):
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left on device.*step 0\\) is intact"):
        store.write_checkpoint(1, disk_full)
    assert store.steps() == [0]


def test_leftover_temporaries_are_removed_on_open(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    leftover = store.checkpoints / ".tmp-0003-123-456"
    leftover.mkdir()
    (leftover / "adapter_model.safetensors").write_bytes(b"half")
    reader = ModelStore(tmp_path, "proj", "m1")
    assert leftover.exists()  # a reader never deletes what may be another process's staging
    writer = ModelStore(tmp_path, "proj", "m1")
    writer.acquire_writer()
    assert not leftover.exists()  # the writer knows no other writer is alive: a crash left it
    writer.release_writer()
    assert reader.steps() == []


def test_one_writer_per_model_directory(tmp_path):
    first, second = ModelStore(tmp_path, "proj", "m1"), ModelStore(tmp_path, "proj", "m1")
    first.acquire_writer()
    with pytest.raises(StoreLockedError, match=f"this process \\(pid {os.getpid()}: a backend here"):
        second.acquire_writer()
    first.release_writer()
    second.acquire_writer()  # released: the next writer gets it
    second.release_writer()


def test_the_writer_lock_dies_with_its_process(tmp_path):
    """SIGKILL the holder: the kernel releases the lock, and the next writer takes it at once."""
    code = ("import sys, time; from art_nb.store import ModelStore; s = ModelStore(sys.argv[1], 'proj', 'm1'); "
            "s.acquire_writer(); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            ModelStore(tmp_path, "proj", "m1").acquire_writer()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    store = ModelStore(tmp_path, "proj", "m1")
    store.acquire_writer()
    store.release_writer()


def test_rewriting_a_step_swaps_atomically(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    store.write_checkpoint(2, write_files)
    store.write_checkpoint(2, lambda d: (d / "adapter_config.json").write_text('{"v": 2}'))
    assert json.loads((store.checkpoint_dir(2) / "adapter_config.json").read_text()) == {"v": 2}
    assert store.steps() == [2]


def test_delete(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    for step in range(3):
        store.write_checkpoint(step, write_files)
    assert store.delete_checkpoints([0, 1, 7]) == [0, 1]
    assert store.steps() == [2]


@pytest.mark.parametrize("bad", ["../evil", "a/b", "..", "", ".hidden", "a@1", "x" * 200, "a\\b", "a..b"])
def test_names_that_escape_are_rejected(tmp_path, bad):
    with pytest.raises(ValueError, match="not allowed"):
        check_name("name", bad)
    with pytest.raises(ValueError):
        ModelStore(tmp_path, "proj", bad)
    assert os.listdir(tmp_path) in ([], ["proj"])


def test_history_survives_a_torn_last_line(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    store.append_history({"step": 1, "reward": 0.5})
    with open(store.dir / "history.jsonl", "a") as handle:
        handle.write('{"step": 2, "rew')
    assert store.read_history() == [{"step": 1, "reward": 0.5}]


def test_trajectories_are_appended_per_split_and_step(tmp_path):
    store = ModelStore(tmp_path, "proj", "m1")
    path = store.append_trajectories("train", 3, [{"reward": 1}, {"reward": 0}])
    assert path == store.dir / "trajectories/train/0003.jsonl"
    assert len(path.read_text().splitlines()) == 2
    with pytest.raises(ValueError):
        store.append_trajectories("../x", 0, [])


# --- links planted inside the store are never followed out of it --------------------------------


def test_the_writer_lock_is_never_truncated_through_a_link(tmp_path):
    """`.writer.lock` linked to a file outside: register truncated that file and wrote a pid into it."""
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    store = ModelStore(tmp_path / "root", "proj", "m1")
    (store.dir / ".writer.lock").symlink_to(outside)
    with pytest.raises(StorePathError, match=r"proj/models/m1/\.writer\.lock is a symbolic link.*remove the link"):
        store.acquire_writer()
    assert outside.read_text() == "precious"
    (store.dir / ".writer.lock").unlink()
    os.link(outside, store.dir / ".writer.lock")  # a hard link is the same file under another name
    with pytest.raises(StorePathError, match="2 hard links"):
        store.acquire_writer()
    assert outside.read_text() == "precious"


def test_logs_are_never_appended_through_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "notes.txt").write_text("precious\n")
    store = ModelStore(tmp_path / "root", "proj", "m1")
    (store.dir / "history.jsonl").symlink_to(outside / "notes.txt")
    with pytest.raises(StorePathError, match="history.jsonl is a symbolic link"):
        store.append_history({"step": 0})
    (store.dir / "trajectories").mkdir()
    (store.dir / "trajectories" / "val").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorePathError, match="trajectories/val is not a directory of the store"):
        store.append_trajectories("val", 0, [{"reward": 1}])
    assert sorted(os.listdir(outside)) == ["notes.txt"] and (outside / "notes.txt").read_text() == "precious\n"


def test_a_model_directory_that_leads_out_through_a_link_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "root" / "proj").mkdir(parents=True)
    (tmp_path / "root" / "proj" / "models").symlink_to(outside, target_is_directory=True)
    with pytest.raises(StorePathError, match="proj/models is not a directory of the store"):
        ModelStore(tmp_path / "root", "proj", "m1")
    assert os.listdir(outside) == []


def test_a_linked_step_directory_is_not_a_checkpoint_and_deleting_it_touches_nothing_outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "adapter_model.safetensors").write_bytes(b"theirs")
    store = ModelStore(tmp_path / "root", "proj", "m1")
    store.write_checkpoint(0, write_files)
    (store.checkpoints / "0005").symlink_to(outside, target_is_directory=True)
    assert store.steps() == [0]
    store.delete_checkpoints([5])
    store.acquire_writer()  # removes temporaries: a link among them is unlinked, never followed
    store.release_writer()
    assert (outside / "adapter_model.safetensors").read_bytes() == b"theirs"


def test_only_plain_files_of_a_checkpoint_are_servable(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside --path")
    store = ModelStore(tmp_path / "root", "proj", "m1")
    store.write_checkpoint(0, write_files)
    checkpoint = store.checkpoint_dir(0)
    (checkpoint / "notes.txt").symlink_to(secret)
    os.link(secret, checkpoint / "hard.txt")
    assert [p.name for p in servable_files(checkpoint, store.dir)] == [
        "adapter_config.json", "adapter_model.safetensors", "meta.json"]
    with open_servable(checkpoint, "adapter_config.json", store.dir) as handle:
        assert handle.read() == b"{}"
    for name in ("notes.txt", "hard.txt", "../../../../../secret.txt"):
        with pytest.raises(FileNotFoundError):
            open_servable(checkpoint, name, store.dir)
    other = ModelStore(tmp_path / "root", "proj", "m2")
    with pytest.raises(StorePathError, match="link out of the model directory"):
        servable_files(checkpoint, other.dir)  # a checkpoint that is not inside the model's directory


# --- damaged log lines --------------------------------------------------------------------------


def test_a_history_line_that_is_not_utf8_is_skipped_with_a_warning_naming_it(tmp_path, caplog):
    """One latin-1 byte made the whole history unreadable (UnicodeDecodeError; the delete route answered 500)."""
    store = ModelStore(tmp_path, "proj", "m1")
    store.append_history({"step": 0, "val/reward": 0.5})
    with open(store.dir / "history.jsonl", "ab") as handle:
        handle.write('{"step": 1, "val/reward": 0.9, "note": "caf\u00e9"}\n'.encode("latin-1"))
        handle.write(b"[1, 2]\n")
    store.append_history({"step": 2, "val/reward": 0.7})
    with caplog.at_level("WARNING", logger="art_nb"):
        assert [line["step"] for line in store.read_history()] == [0, 2]
        store.read_history()  # read again (the dashboard does): warned once per line
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "history.jsonl line 2 is skipped" in warnings[0] and "UnicodeDecodeError" in warnings[0]
    assert "history.jsonl line 3 is skipped" in warnings[1] and "a JSON list, not an object" in warnings[1]
