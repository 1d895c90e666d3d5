"""A captured trajectory (a rollout written with plain HTTP inside `art.trajectory`) shows its
conversation everywhere a trajectory is shown: `messages()`, the run's JSONL records, the viewer,
`trajectories_dataset`, RULER's judge prompt; and what trains stays the server's ids.

Same scripted server as tests/unit/test_capture.py (no model weights): turn 1 answers with a tool
call, turn 2 with text, so tool calls, tool results and sampled flags are all exercised.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import httpx
import pytest

import art_nb as art
from art_nb.capture import CapturedCall, CapturedChoice
from art_nb.grpo.captured import captured_sequence
from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.notebook.viewer import (
    conversation_html,
    conversation_text,
    read_records,
    show_trajectory,
)
from art_nb.records import record_groups
from art_nb.rewards import ruler_score_group
from art_nb.rewards.ruler_judge import Judge
from art_nb.store import ModelStore, trajectory_files
from tests.unit import test_capture
from tests.unit.test_capture import KEY, check_exact

pytestmark = pytest.mark.asyncio(loop_scope="module")
server, srv = test_capture.server, test_capture.srv  # its scripted server, as fixtures here

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b",
                                           "parameters": {"type": "object", "properties": {}}}}]
# Written the way the template renders a call back, as a model trained on its template writes it
# (otherwise call 2's prompt re-renders the call and capture refuses the history as not append-only).
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def script(prompt: str) -> str:
    return "the sum is 5" if "<|im_start|>tool" in prompt else CALL


async def tool_rollout(srv: Any, word: str = "add 2 and 3") -> None:
    """Plain httpx, no SDK: ask, run the tool the model called, ask again."""
    async with httpx.AsyncClient(base_url=srv.base_url, headers={"Authorization": f"Bearer {KEY}"}) as http:
        messages: list[dict[str, Any]] = [{"role": "system", "content": "use tools"}, {"role": "user", "content": word}]
        first = (await http.post("/chat/completions", json={"model": "agent", "messages": messages, "tools": TOOLS}))
        reply = first.json()["choices"][0]["message"]
        messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}]
        await http.post("/chat/completions", json={"model": "agent", "messages": messages, "tools": TOOLS})
    art.current_trajectory(required=True).reward = 1.0


async def captured(srv: Any, word: str = "add 2 and 3") -> art.Trajectory:
    srv.engines["agent"].script = script
    return await art.trajectory(tool_rollout(srv, word))


def assert_conversation(messages: list[dict[str, Any]], sampled: list[bool]) -> None:
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert sampled == [False, False, True, False, True]
    call = messages[2]["tool_calls"][0]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert messages[3]["tool_call_id"] == call["id"] and messages[4]["content"] == "the sum is 5"


async def test_messages_show_the_captured_conversation_and_training_is_unchanged(srv: Any) -> None:
    t = await captured(srv)
    assert t.messages_and_choices == []  # nothing stored twice: the view is derived from the calls
    assert_conversation(t.messages(), t.sampled())
    assert t.conversation_tools() == TOOLS and len(t.choices()) == 2
    assert [c.token_ids for c in t.choices()] == srv.engines["agent"].sampled  # type: ignore[attr-defined]
    assert str(t) == "Trajectory(reward=1.000, messages=5)"
    logged = t.for_logging()
    assert [m["trainable"] for m in logged["messages"]] == [False, False, True, False, True]
    assert logged["tools"] == TOOLS
    check_exact(t, srv)  # the trained ids are the sampled ones, as before
    tok = srv.engines["agent"].tokenizer
    seq = captured_sequence(tok, t.exchanges)
    assert tokenize_trajectory(tok, t, 10_000).input_ids == seq.input_ids
    # The view's Choices carry the sampled ids: built by hand from it, the same tokens train.
    by_hand = tokenize_trajectory(tok, art.Trajectory(messages_and_choices=t.conversation(), tools=TOOLS), 10_000)
    assert by_hand.retokenized_choices == 0
    assert [i for i, m in zip(by_hand.input_ids, by_hand.assistant_mask) if m] == \
        [i for i, m in zip(seq.input_ids, seq.assistant_mask) if m]


async def test_records_viewer_and_dataset_show_it(srv: Any, tmp_path: Any) -> None:
    t = await captured(srv)
    store = ModelStore(tmp_path, "proj", "agent")
    record_groups(store, "agent", "train", 0, [art.TrajectoryGroup([t])])
    [(_, _, path)] = trajectory_files(store.dir)
    [record] = read_records(path)
    assert_conversation(record["messages"], record["sampled"])
    assert record["tools"] == TOOLS
    for view in (record, show_trajectory(t).record):
        text = conversation_text(view)
        assert "the sum is 5" in text and "→ add(" in text and "not played by the model" not in text
        assert "the sum is 5" in conversation_html(view)
    from art_nb.datasets_io import trajectories_dataset

    [row] = trajectories_dataset(store.dir).to_list()
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert row["sampled"] == [False, False, True, False, True] and row["messages"][4]["content"] == "the sum is 5"
    assert row["messages"][2]["tool_calls"][0]["function"]["name"] == "add"


async def test_ruler_judges_the_captured_conversation(srv: Any, tmp_path: Any, monkeypatch: Any) -> None:
    group = art.TrajectoryGroup([await captured(srv, "add 2 and 3"), await captured(srv, "add two and three")])
    asked: list[list[dict[str, Any]]] = []

    async def create(messages: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, Any]:
        asked.append(messages)
        scores = [{"trajectory_id": str(i), "explanation": "ok", "score": 0.5} for i in (1, 2)]
        return {"choices": [{"index": 0, "message": {"role": "assistant", "content": json.dumps({"scores": scores})}}]}

    ruler_mod = importlib.import_module("art_nb.rewards.ruler")
    monkeypatch.setattr(ruler_mod, "resolve_judge", lambda judge_model, extra=None: Judge(label="fake", local=False, create=create))
    scored = await ruler_score_group(group, "openai/o3", cache_dir=tmp_path)
    assert [t.reward for t in scored] == [0.5, 0.5]
    page = asked[0][-1]["content"]
    assert "the sum is 5" in page and "add two and three" in page and '"add"' in page


def _call(messages: list[dict[str, Any]], *choices: CapturedChoice) -> CapturedCall:
    return CapturedCall(model="agent", prompt_token_ids=[1], choices=list(choices), request={"messages": messages})


async def test_the_conversation_shows_the_branch_the_client_continued_and_what_it_cannot_place() -> None:
    user = {"role": "user", "content": "hi"}
    a = CapturedChoice(index=0, token_ids=[5], finish_reason="stop", message={"role": "assistant", "content": "A"})
    b = CapturedChoice(index=1, token_ids=[6], finish_reason=None, message={"role": "assistant", "content": "B"})
    last = CapturedChoice(token_ids=[7], finish_reason="length", message={"role": "assistant", "content": "C"})
    t = art.Trajectory(exchanges=[_call([user], a, b), _call([user, {"role": "assistant", "content": "B"}, user], last)])
    assert [m.get("content") for m in t.messages()] == ["hi", "B", "hi", "C"] and t.sampled() == [False, True, False, True]
    assert t.choices()[0].finish_reason is None and t.choices()[1].token_ids == [7]  # type: ignore[attr-defined]
    # An edited history (no assistant turn where call 0's reply should be) shows what the client sent.
    edited = art.Trajectory(exchanges=[_call([user], a), _call([{"role": "user", "content": "summary"}, user], last)])
    assert edited.sampled() == [False, False, True] and edited.messages()[0]["content"] == "summary"
    assert art.Trajectory(exchanges=[_call([], a)]).messages() == [{"role": "assistant", "content": "A"}]
    assert art.Trajectory().conversation() == [] and art.Trajectory().conversation_tools() is None


async def test_the_wire_form_is_unchanged() -> None:
    from art_nb.wire import trajectory_to_wire

    user = {"role": "user", "content": "hi"}
    reply = CapturedChoice(token_ids=[5], finish_reason="stop", message={"role": "assistant", "content": "A"})
    wire = trajectory_to_wire(art.Trajectory(exchanges=[_call([user], reply)]))
    assert wire["messages_and_choices"] == [] and len(wire["exchanges"]) == 1


async def test_sft_and_truncation_masking_read_the_captured_conversation(srv: Any) -> None:
    """SFT labels a captured trajectory's sampled replies (it used to see no assistant turn), and
    mask_truncated_completions sees a captured last call that stopped at the token limit."""
    from art_nb.grpo.advantages import prepare_batch
    from art_nb.grpo.sft import tokenize_sft

    t = await captured(srv)
    tok = srv.engines["agent"].tokenizer
    labelled = tokenize_sft(tok, t, 10_000)
    labels = [i for i, m in zip(labelled.input_ids, labelled.assistant_mask) if m]
    assert labels and tok.decode(labels).count("the sum is 5") == 1

    other = await captured(srv, "add 1 and 4")
    other.reward = 0.0
    other.exchanges[-1].choices[0].finish_reason = "length"  # the last call ran out of tokens
    config = art.TrainConfig(mask_truncated_completions=True)
    batch = prepare_batch([art.TrajectoryGroup([t, other])], tok, config, max_seq_len=10_000)
    assert batch.masked_truncated == 1 and len(batch.items) == 1
