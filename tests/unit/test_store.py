import json
import os
import signal
import subprocess
import sys

import pytest

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
    with pytest.raises(StoreLockedError, match=f"another process \\(pid {os.getpid()}\\)"):
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
