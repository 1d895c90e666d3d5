"""Shared test helpers: a tiny ChatML tokenizer built in-process (no download), endpoint-like Choices;
and the order test files are handed to pytest-xdist workers in (longest first, see below)."""

from __future__ import annotations

import os

import pytest

# scripts/test.sh runs the suite on two xdist workers, a file per work unit (--dist loadfile, so a
# module's fixtures such as the notebooks' shared run or the vLLM check stay in one process). Files are
# handed out in collection order; giving out the longest first keeps one worker from starting a
# 2-minute file while the other has nothing left. Seconds per file on a 2-core CPU, the slowest
# first (fresh-clone CI logs): notebooks ~170 (two kernels), install cell ~130, compat
# ~120 (a test at a time, below), browser ~115, vLLM CPU ~60 + ~35; then the integration and fault
# files; the unit files, each a few seconds, fill the end. New files go after the listed ones, in their directory's place.
_LONGEST_FIRST = (
    "notebooks/test_notebooks.py",
    "notebooks/test_install_cell.py",
    "compat/test_examples.py",
    "ui/test_dashboard_ui.py",
    "vllm_cpu/test_vllm_engine_cpu.py",
    "vllm_cpu/test_vllm_backend_cpu.py",
    "integration/test_local_backend.py",
    "integration/test_remote_backend.py",
    "faults/test_http_hardening.py",
)
_DIRECTORY_ORDER = ("notebooks", "ui", "vllm_cpu", "compat", "integration", "faults", "gpu", "unit")


def _file_rank(item: pytest.Item) -> tuple[int, int]:
    relative = item.path.relative_to(os.path.dirname(__file__)).as_posix()
    if relative in _LONGEST_FIRST:
        return 0, _LONGEST_FIRST.index(relative)
    directory = relative.split("/", 1)[0]
    place = _DIRECTORY_ORDER.index(directory) if directory in _DIRECTORY_ORDER else len(_DIRECTORY_ORDER)
    return 1, place


# Files whose tests share no module fixture and each take minutes: under --dist loadfile each of their
# tests is a work unit of its own, so both workers share them (the five ART programs, ~25 s each).
_SPLIT_PER_TEST = ("compat/test_examples.py",)


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """--dist loadfile, except that the files in `_SPLIT_PER_TEST` are handed out a test at a time."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrTestScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.removeprefix("tests/") in _SPLIT_PER_TEST else path

    return FileOrTestScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist only: longest files first (a stable sort, so a file's own order is kept). A plain
    run keeps pytest's order, which is the one the suite has always passed in."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=_file_rank)

# ChatML as SmolLM2 writes it (a default system prompt when none is given), plus tools and tool calls
# the way Qwen-style ChatML templates render them.
CHATML_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system = messages[0]['content'] -%}{%- set rest = messages[1:] -%}"
    "{%- else -%}{%- set system = 'You are a helpful assistant.' -%}{%- set rest = messages -%}{%- endif -%}"
    "{{- '<|im_start|>system\\n' + system -}}"
    "{%- if tools -%}{{- '\\n\\n# Tools\\n' -}}{%- for tool in tools -%}{{- tool | tojson -}}{{- '\\n' -}}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- for message in rest -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] -%}{{- message['content'] -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_CORPUS = [
    "You are a helpful assistant. What is two plus two? Two plus two is four.",
    "The weather in Paris is sunny today. Call the tool get_weather with the city name.",
    'Tool results: {"city": "Paris", "temperature": 21}. Thanks, that is all.',
    "system user assistant tool <tool_call> </tool_call> name arguments",
] * 4


def build_chatml_tokenizer(template: str = CHATML_TEMPLATE):
    """A byte-level BPE (so every string round-trips exactly) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=template,
    )


def char_ids(tokenizer, text: str) -> list[int]:
    """One id per character: a valid but non-canonical tokenisation, as a sampler may produce."""
    return [i for ch in text for i in tokenizer.encode(ch, add_special_tokens=False)]


def make_choice(tokenizer, text: str, *, eos: bool = True, tool_calls=None, send_ids: bool = True):
    """A Choice as our endpoint returns it: `token_ids` extra field and one logprob per sampled id."""
    from openai.types.chat.chat_completion import Choice

    ids = char_ids(tokenizer, text) + ([tokenizer.eos_token_id] if eos else [])
    logprobs = [-0.01 * (n + 1) for n in range(len(ids))]
    data = {
        "index": 0,
        "finish_reason": ("tool_calls" if tool_calls else "stop") if eos else "length",
        "message": {"role": "assistant", "content": None if tool_calls else text, "tool_calls": tool_calls},
        "logprobs": {
            "content": [
                {"token": str(i), "logprob": lp, "bytes": None, "top_logprobs": []}
                for i, lp in zip(ids, logprobs)
            ]
        },
    }
    if send_ids:
        data["token_ids"] = ids
    return Choice.model_validate(data)


@pytest.fixture
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a busy 2-core box threads make them 30x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def chatml_tokenizer():
    return build_chatml_tokenizer()


class FakeModel:
    """Stands in for `art_nb.Model` in env unit tests: an OpenAI-shaped client whose replies come
    from `policy(last user message)`. The real endpoint is covered by the integration tests."""

    def __init__(self, policy, inference_name: str = "tiny@3") -> None:
        import itertools

        self.policy = policy
        self.inference_name = inference_name
        self.calls: list[dict] = []
        self._ids = itertools.count()

    def get_inference_name(self) -> str:
        return self.inference_name

    def openai_client(self):
        from types import SimpleNamespace

        return SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=self._create)))

    async def _create(self, **request):
        from openai.types.chat import ChatCompletion

        self.calls.append(request)
        content = self.policy(request["messages"][-1]["content"])
        choice = {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": content},
            "logprobs": {"content": [{"token": "<", "logprob": -0.5, "top_logprobs": []}]},
            "token_ids": [1, 2, 3],
        }
        return ChatCompletion.model_validate(
            {"id": f"chatcmpl-{next(self._ids)}", "object": "chat.completion", "created": 0,
             "model": request["model"], "choices": [choice]}
        )
