"""Export: a PEFT directory that loads, a zip, a 16-bit merge that matches base + LoRA, and a Hub push
whose token is used but never shown. Runs on a tiny random Llama made in the test (no download)."""

from __future__ import annotations

import json
import logging
import zipfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from art_nb.local.export import ExportResult, export_adapter, find_hub_token

SECRET = "hf_do_not_print_me_0123456789"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, chatml_tokenizer):
    """A base model directory and a checkpoint directory laid out like the store writes them."""
    root = tmp_path_factory.mktemp("export")
    base_dir = root / "base"
    config = transformers.LlamaConfig(vocab_size=len(chatml_tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config)
    base.save_pretrained(base_dir)
    chatml_tokenizer.save_pretrained(base_dir)

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # a trained-looking adapter: B is not zero, so the merge changes the weights
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    ckpt = root / "checkpoints" / "0003"
    model.save_pretrained(ckpt)
    (ckpt / "trainer_state.pt").write_bytes(b"optimizer state, not exported")
    (ckpt / "meta.json").write_text(json.dumps({"step": 3, "base_model": str(base_dir)}))
    return base_dir, ckpt


@pytest.fixture
def no_saved_login(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)


def test_adapter_dir_and_zip_load_with_peft(checkpoint, tmp_path):
    base_dir, ckpt = checkpoint
    result = export_adapter(ckpt, tmp_path, name="ttt", base_model=str(base_dir))
    assert result.step == 3
    assert result.adapter_dir == tmp_path / "ttt-step3-lora"
    files = {p.name for p in result.adapter_dir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= files
    assert "trainer_state.pt" not in files  # optimizer state stays with the checkpoint
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir)

    with zipfile.ZipFile(result.zip_path) as archive:
        names = set(archive.namelist())
    assert "ttt-step3-lora/adapter_model.safetensors" in names and "ttt-step3-lora/adapter_config.json" in names

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    loaded = peft.PeftModel.from_pretrained(base, result.adapter_dir)
    expected = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), ckpt)
    ids = torch.tensor([[1, 5, 9, 13]])
    assert torch.allclose(loaded(ids).logits, expected(ids).logits)


def test_base_model_named_in_the_adapter_is_the_users_hub_id(checkpoint, tmp_path, monkeypatch):
    import art_nb.local.export

    monkeypatch.setattr(art_nb.local.export, "_local_base_dir", lambda base_model: None)  # no hub lookup in a unit test
    _, ckpt = checkpoint
    result = export_adapter(ckpt, tmp_path, name="m", base_model="HuggingFaceTB/SmolLM2-135M-Instruct", make_zip=False)
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert result.zip_path is None
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in (result.adapter_dir / "README.md").read_text()


def test_merge_writes_a_16_bit_model_equal_to_base_plus_lora(checkpoint, tmp_path):
    base_dir, ckpt = checkpoint
    result = export_adapter(ckpt, tmp_path, name="m", base_model=str(base_dir), merge=True)
    assert any("merged in float16" in note for note in result.notes)  # the base is float32, so float16
    merged = transformers.AutoModelForCausalLM.from_pretrained(result.merged_dir, dtype="auto")  # transformers 4 loads float32 unless asked
    assert merged.dtype == torch.float16
    assert not any("lora" in name for name, _ in merged.named_parameters())
    reference = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base_dir), ckpt)
    base_only = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    ids = torch.tensor([[2, 4, 6, 8, 10]])
    got = merged.float()(ids).logits
    want = reference(ids).logits
    assert torch.allclose(got, want, atol=2e-2), (got - want).abs().max()
    assert not torch.allclose(base_only(ids).logits, want, atol=2e-2)  # the LoRA really changes the output


def test_hub_push_uses_the_token_and_never_shows_it(checkpoint, tmp_path, monkeypatch, capsys, caplog):
    import huggingface_hub

    _, ckpt = checkpoint
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("token", token))

        def create_repo(self, repo_id, private, exist_ok):
            calls.append(("create", repo_id, private))

        def upload_folder(self, folder_path, repo_id, commit_message):
            calls.append(("upload", sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    caplog.set_level(logging.DEBUG)
    result = export_adapter(ckpt, tmp_path, name="m", hub_repo="someone/m-lora")
    assert calls[0] == ("token", SECRET)
    assert calls[1] == ("create", "someone/m-lora", True)
    assert "adapter_model.safetensors" in calls[2][1]
    assert result.hub_url == "https://huggingface.co/someone/m-lora"
    assert any("environment variable HF_TOKEN" in note for note in result.notes)
    shown = str(result) + repr(result) + capsys.readouterr().out + caplog.text
    assert SECRET not in shown
    written = "".join(p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file())
    assert SECRET not in written


def test_no_token_skips_the_push_with_a_reason(checkpoint, tmp_path, no_saved_login, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda **_: pytest.fail("no token: the Hub must not be called"))
    result = export_adapter(checkpoint[1], tmp_path, name="m", hub_repo="someone/m-lora")
    assert result.hub_url is None
    assert any(note.startswith("hub push skipped: no Hugging Face token") for note in result.notes)
    assert result.adapter_dir.is_dir()


def _found(secret):
    return (secret.reveal(), secret.source)


def test_token_sources_in_order(monkeypatch, no_saved_login):
    assert find_hub_token() is None
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "b")
    assert _found(find_hub_token()) == ("b", "environment variable HUGGING_FACE_HUB_TOKEN")
    monkeypatch.setenv("HF_TOKEN", "a")
    assert _found(find_hub_token()) == ("a", "environment variable HF_TOKEN")
    assert _found(find_hub_token("c")) == ("c", "argument")
    import huggingface_hub

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN")
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "saved")
    assert _found(find_hub_token()) == ("saved", "huggingface_hub's saved login")


def test_the_hub_token_is_a_masked_secret(monkeypatch, no_saved_login):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    token = find_hub_token()
    assert SECRET not in f"{token} {token!r}" and "HF_TOKEN" in token.source


class _Trained:
    """A backend as export_model sees it: a served step to wait for, and where the run is."""

    def __init__(self, root, step):
        self.root, self.step, self.waited = root, step, 0

    async def wait_for_checkpoint(self, model):
        self.waited += 1
        return self.step

    def model_dir(self, model):
        return self.root


async def test_export_model_waits_for_the_served_checkpoint(checkpoint, tmp_path, monkeypatch):
    import art_nb.local.export
    from art_nb import TrainableModel

    monkeypatch.setattr(art_nb.local.export, "_local_base_dir", lambda base_model: None)
    _, ckpt = checkpoint
    model = TrainableModel(name="ttt", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    backend = _Trained(ckpt.parent.parent, 3)
    result = await art_nb.local.export.export_model(model, backend, tmp_path, make_zip=False)
    assert backend.waited == 1 and result.step == 3 and result.adapter_dir == tmp_path / "ttt-step3-lora"
    with pytest.raises(FileNotFoundError, match=r"no checkpoint 7 .*\(there: \[3\]\).*pull_checkpoint"):
        await art_nb.local.export.export_model(model, backend, tmp_path, step=7)


def test_bad_inputs_are_refused_with_a_fix(checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        export_adapter(tmp_path, tmp_path / "out")
    with pytest.raises(ValueError, match="user/name"):
        export_adapter(checkpoint[1], tmp_path / "out", hub_repo="not a repo")


def test_result_text_lists_what_was_written(tmp_path):
    result = ExportResult(step=2, adapter_dir=tmp_path / "a", zip_path=tmp_path / "a.zip", notes=("merge skipped",))
    text = str(result)
    assert "exported step 2" in text and "a.zip" in text and "merge skipped" in text


def test_show_export_links_the_zip_and_downloads_it_on_colab(tmp_path, monkeypatch):
    import sys
    import types

    from art_nb.notebook import export_view

    zip_path = tmp_path / "m-step2-lora.zip"
    zip_path.write_bytes(b"PK")
    result = ExportResult(step=2, adapter_dir=tmp_path / "m-step2-lora", zip_path=zip_path, notes=("a note",))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(export_view, "in_colab", lambda: False)
    view = export_view.show_export(result)
    page = view._repr_html_()
    assert "href='m-step2-lora.zip'" in page and "a note" in page and not view.downloading

    downloads = []
    colab = types.ModuleType("google.colab")
    colab.files = types.SimpleNamespace(download=downloads.append)
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setattr(export_view, "in_colab", lambda: True)
    view = export_view.show_export(result)
    assert downloads == [str(zip_path)] and view.downloading
    assert "download of the zip has started" in str(view)
    assert export_view.show_export(result, download=False).downloading is False


def test_planted_symlinks_at_the_temporary_names_are_never_followed(checkpoint, tmp_path):
    """The old export wrote through `.{name}.tmp`, a name anyone could plant as a link to elsewhere."""
    base_dir, ckpt = checkpoint
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    (out / ".ttt-step3-lora.zip.tmp").symlink_to(victim / "owned.zip")
    (out / ".ttt-step3-lora.tmp").symlink_to(victim, target_is_directory=True)
    result = export_adapter(ckpt, out, name="ttt", base_model=str(base_dir))
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]  # nothing written or deleted there
    assert (victim / "keep.txt").read_text() == "mine"
    assert result.zip_path.is_file() and not result.zip_path.is_symlink()
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]  # no temporaries left
