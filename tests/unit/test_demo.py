"""The demo script's output: each automatic choice shown once, however many places log it at register."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import art_nb as art
from art_nb.demo import register_and_show_choices

CHOICES = {"base_model": "/cache/SmolLM2 (cache: offline copy)", "engine": "hf: no CUDA GPU"}


class _ChattyBackend:
    """Registers like LocalBackend does: each choice logged at INFO, some of them twice by different parts."""

    def __init__(self) -> None:
        self.registered = []

    async def register(self, model):
        log = logging.getLogger("art_nb")
        log.info("base model %s: /cache/SmolLM2 (cache) — offline copy", model.base_model)  # the resolver
        for key, why in CHOICES.items():
            log.info("%s: %s", key, why)  # the backend
        log.warning("engine: the GPU is busy")  # a warning still shows
        self.registered.append(model.name)

    def choices(self, model):
        return dict(CHOICES)

    def in_process_http_client(self, model: object) -> None:  # the protocol's: no in-process endpoint here
        return None

    def inference_endpoint(self, model):  # the Backend protocol's; register fills the model's fields from it
        from art_nb.types import InferenceEndpoint

        return InferenceEndpoint(base_url="http://127.0.0.1:1/v1", api_key="k")

    def inference_model_name(self, model, step=None):
        return f"{model.name}@{step or 0}"

    def model_dir(self, model):  # where register's reporter would keep a W&B run id (none here: no key)
        return Path(tempfile.gettempdir()) / "art_nb-test-demo" / model.name


async def test_each_choice_is_shown_once(capsys, caplog):
    logger = logging.getLogger("art_nb")
    logger.setLevel(logging.INFO)
    caplog.set_level(logging.INFO, logger="art_nb")
    backend = _ChattyBackend()
    model = art.TrainableModel(name="demo", base_model="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert await register_and_show_choices(model, backend) == CHOICES
    assert backend.registered == ["demo"] and model.backend is backend
    shown = capsys.readouterr().out + "".join(f"{r.getMessage()}\n" for r in caplog.records)
    for why in CHOICES.values():
        assert shown.count(why) == 1, shown
    assert "— offline copy" not in shown  # the resolver's restatement of the base-model choice
    assert "the GPU is busy" in shown
    assert logger.level == logging.INFO  # the script's own level is back for training
