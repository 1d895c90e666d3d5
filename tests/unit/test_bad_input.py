"""Bad input, tried systematically (hypothesis) and by hand.

Every malformed rollout gets a clear error that names the trajectory and the field, or a documented
skip that is counted in the step's metrics; nothing crashes deep inside a train step, and no name
can make art_nb write outside the model directory.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import CHATML_TEMPLATE, build_chatml_tokenizer, make_choice
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import art_nb as art
from art_nb.grpo.advantages import prepare_batch
from art_nb.records import summarize, trajectory_record
from art_nb.store import ModelStore, check_name
from art_nb.trajectories import check_groups

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ROLES = {"system", "developer", "user", "assistant", "tool"}

text = st.text(max_size=30)  # any unicode (hypothesis mixes in emoji, combining marks, RTL, NUL)


@pytest.fixture(scope="module")
def tokenizer():
    return build_chatml_tokenizer()


# ---- strategies ----------------------------------------------------------------------------------


@st.composite
def valid_items(draw: st.DrawFn, tokenizer: Any) -> list[Any]:
    """A conversation a rollout could produce: prompts, Choices (with or without ids or logprobs),
    assistant dicts (context only), tool calls with and without results."""
    items: list[Any] = []
    if draw(st.booleans()):
        items.append({"role": "system", "content": draw(text)})
    for turn in range(draw(st.integers(0, 3))):
        items.append({"role": draw(st.sampled_from(["user", "developer"])), "content": draw(text)})
        kind = draw(st.sampled_from(["choice", "choice_no_ids", "choice_no_logprobs", "assistant_dict", "tool_call",
                                     "none"]))
        if kind == "choice":
            items.append(make_choice(tokenizer, draw(text), eos=draw(st.booleans())))
        elif kind == "choice_no_ids":
            items.append(make_choice(tokenizer, draw(text), send_ids=False))
        elif kind == "choice_no_logprobs":
            choice = make_choice(tokenizer, draw(text))
            items.append(choice.model_copy(update={"logprobs": None}))
        elif kind == "assistant_dict":
            items.append({"role": "assistant", "content": draw(text)})
        elif kind == "tool_call":
            call_id = f"call_{turn}"
            call = {"id": call_id, "type": "function", "function": {"name": "lookup", "arguments": json.dumps({"q": draw(text)})}}
            items.append(make_choice(tokenizer, "", tool_calls=[call]))
            if draw(st.booleans()):  # a tool call may go unanswered (the rollout ended there)
                items.append({"role": "tool", "tool_call_id": call_id, "content": draw(text)})
    return items


bad_items = st.one_of(
    st.tuples(st.integers() | st.none() | st.lists(st.integers(), max_size=2), st.just("expected a message dict")),
    st.tuples(text.filter(lambda r: r not in ROLES).map(lambda r: {"role": r, "content": "x"}), st.just("has role")),
    st.tuples(st.just({"content": "no role"}), st.just("has role None")),
    st.tuples(st.integers().map(lambda n: {"role": "user", "content": n}), st.just("['content'] is a int")),
)


# ---- trajectories --------------------------------------------------------------------------------


@SETTINGS
@given(data=st.data())
def test_a_bad_message_is_rejected_naming_its_index(tokenizer, data: st.DataObject) -> None:
    items = data.draw(valid_items(tokenizer))
    bad, expected = data.draw(bad_items)
    index = data.draw(st.integers(0, len(items)))
    items.insert(index, bad)
    with pytest.raises(ValidationError) as caught:
        art.Trajectory(messages_and_choices=items, reward=1.0)
    message = str(caught.value)
    assert f"messages_and_choices[{index}]" in message and expected in message, message


@SETTINGS
@given(reward=st.floats())
def test_rewards_must_be_finite_at_construction_and_assignment(reward: float) -> None:
    if math.isfinite(reward):
        trajectory = art.Trajectory(reward=reward)
        trajectory.reward = reward
        assert trajectory.reward == reward
        return
    with pytest.raises(ValidationError, match="reward.*must be finite"):
        art.Trajectory(reward=reward)
    trajectory = art.Trajectory(reward=0.0)
    with pytest.raises(ValidationError, match="reward.*must be finite"):
        trajectory.reward = reward  # the usual rollout pattern: build first, score later
    assert trajectory.reward == 0.0


def test_a_trajectory_changed_in_place_is_checked_before_training(tokenizer) -> None:
    good = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}, make_choice(tokenizer, "yo")], reward=1)
    changed = art.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"}], reward=0)
    changed.messages_and_choices.append({"role": "bot", "content": "?"})  # not seen by any validator
    with pytest.raises(ValueError, match=r"groups\[1\]\.trajectories\[0\] is invalid: messages_and_choices: "
                                         r"messages_and_choices\[1\] has role 'bot'"):
        check_groups([art.TrajectoryGroup([good]), art.TrajectoryGroup([changed])])
    check_groups([art.TrajectoryGroup([good])])


def test_tool_results_are_taken_as_art_takes_them() -> None:
    # ART's rock-paper-scissors notebook answers "n/a" when the model made no call, and a result may
    # carry no id at all: both are accepted at construction, on assignment and when grouped.
    t = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                             {"role": "tool", "tool_call_id": "n/a", "content": "r"}])
    t.messages_and_choices.append({"role": "tool", "content": "no id"})
    t.reward += 1  # assignment validates the whole trajectory again
    check_groups([art.TrajectoryGroup([t])])


def test_metrics_of_the_wrong_type_name_the_key() -> None:
    with pytest.raises(ValidationError, match=r"metrics\.turns"):
        art.Trajectory(metrics={"turns": "three"})


def test_huge_metrics_and_unicode_survive_logging(tmp_path: Path) -> None:
    metrics = {f"metric_{i}_\u00e9\u4e2d": float(i) for i in range(5000)} | {"nan": math.nan, "inf": math.inf}
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "\u202e\U0001f600\x00 e\u0301"}],
                                reward=0.5, metrics=metrics, metadata={"\u2603": ["\ud7ff", None]})
    summary = summarize([art.TrajectoryGroup([trajectory])])
    assert summary["metric_4999_\u00e9\u4e2d"] == 4999.0 and "nan" not in summary  # non-finite means are dropped
    store = ModelStore(tmp_path, "p", "m")
    path = store.append_trajectories("train", 0, [trajectory_record(trajectory, group=0)])
    record = json.loads(path.read_text())
    assert record["messages"][0]["content"] == "\u202e\U0001f600\x00 e\u0301" and len(record["metrics"]) == 5002


# ---- the batch GRPO trains on ------------------------------------------------------------------


rewards = st.one_of(st.sampled_from([0.0, 1.0, -1.0, 0.5, 1e6, -1e-9]), st.floats(-1e3, 1e3, width=32))


@SETTINGS
@given(data=st.data(), max_seq_len=st.integers(4, 160))
def test_prepare_batch_never_crashes_and_counts_every_skip(tokenizer, data: st.DataObject, max_seq_len: int) -> None:
    groups = []
    for _ in range(data.draw(st.integers(0, 4))):
        size = data.draw(st.integers(0, 4))
        trajectories = [art.Trajectory(messages_and_choices=data.draw(valid_items(tokenizer)), reward=data.draw(rewards))
                        for _ in range(size)]
        groups.append(art.TrajectoryGroup(trajectories))
    batch = prepare_batch(groups, tokenizer, art.TrainConfig(), max_seq_len)

    empty = sum(1 for g in groups if not g.trajectories)
    flat = [g for g in groups if g.trajectories and len(set(g.rewards())) == 1]  # groups of one included
    signal = [g for g in groups if len(set(g.rewards())) > 1]
    assert batch.empty_groups == empty and batch.zero_variance_groups == len(flat)
    assert len(batch.items) + batch.skipped_trajectories == sum(len(g) for g in signal)
    assert batch.truncated <= sum(len(g) for g in signal)
    for item in batch.items:
        assert len(item.input_ids) <= max_seq_len and item.trainable_tokens > 0
        assert len(item.input_ids) == len(item.assistant_mask) == len(item.engine_logprobs)
        assert math.isfinite(item.advantage)
        assert all(0 <= i < len(tokenizer) for i in item.input_ids)
    for index, group in enumerate(groups):
        advantages = [item.advantage for item in batch.items if item.group_index == index]
        if len(advantages) == len(group) and advantages:
            assert abs(sum(advantages)) < 1e-6 * len(advantages)  # relative to the group: centred
    assert set(batch.metrics()) >= {"empty_groups", "zero_variance_groups", "truncated", "skipped_trajectories",
                                    "retokenized_choices"}


def test_each_skip_is_counted_by_hand(tokenizer) -> None:
    prompt = {"role": "user", "content": "Name a colour."}
    choice = make_choice(tokenizer, "blue")
    groups = [
        art.TrajectoryGroup([]),  # every rollout failed
        art.TrajectoryGroup([art.Trajectory(messages_and_choices=[prompt, choice], reward=1)]),  # a group of one
        art.TrajectoryGroup([art.Trajectory(messages_and_choices=[prompt, choice], reward=2)] * 3),  # all equal
        art.TrajectoryGroup([
            art.Trajectory(messages_and_choices=[prompt], reward=0),  # no assistant turn
            art.Trajectory(messages_and_choices=[prompt, {"role": "assistant", "content": "red"}], reward=1),  # dict only
            art.Trajectory(messages_and_choices=[prompt, make_choice(tokenizer, "green", send_ids=False)], reward=2),
            art.Trajectory(messages_and_choices=[{"role": "user", "content": "x" * 5000}, choice], reward=3),  # oversize
            art.Trajectory(messages_and_choices=[prompt, choice], reward=4),
        ]),
    ]
    batch = prepare_batch(groups, tokenizer, art.TrainConfig(), max_seq_len=128)
    assert batch.empty_groups == 1 and batch.zero_variance_groups == 2
    assert batch.skipped_trajectories == 3  # no turn, dict only, and the choice cut off by max_seq_len
    assert batch.truncated == 1 and batch.retokenized_choices == 1 and len(batch.items) == 2


def test_a_template_that_rejects_a_conversation_names_the_trajectory() -> None:
    picky = build_chatml_tokenizer(CHATML_TEMPLATE.replace(
        "{%- for message in rest -%}",
        "{%- for message in rest -%}{%- if message['role'] == 'developer' -%}"
        "{{ raise_exception('developer messages are not supported') }}{%- endif -%}"))
    prompt = {"role": "user", "content": "hi"}
    groups = [art.TrajectoryGroup([
        art.Trajectory(messages_and_choices=[prompt, make_choice(picky, "a")], reward=0),
        art.Trajectory(messages_and_choices=[{"role": "developer", "content": "x"}, make_choice(picky, "b")], reward=1),
    ])]
    with pytest.raises(ValueError, match=r"groups\[0\]\.trajectories\[1\] could not be tokenized.*developer messages"):
        prepare_batch(groups, picky, art.TrainConfig(), max_seq_len=256)


# ---- gather ----------------------------------------------------------------------------------


@SETTINGS
@given(outcomes=st.lists(st.lists(st.sampled_from(["ok", "error"]), max_size=4), max_size=4),
       max_exceptions=st.one_of(st.integers(0, 6), st.floats(0.0, 0.99)))
def test_gather_counts_failures_against_the_budget(outcomes: list[list[str]], max_exceptions: float) -> None:
    async def rollout(outcome: str, reward: float) -> art.Trajectory:
        await asyncio.sleep(0)
        if outcome == "error":
            raise ValueError("the environment broke")
        return art.Trajectory(reward=reward)

    async def gather() -> list[art.TrajectoryGroup]:
        groups = [art.TrajectoryGroup(rollout(o, i) for i, o in enumerate(group)) for group in outcomes]
        return await art.gather_trajectory_groups(groups, pbar_desc=None, max_exceptions=max_exceptions)

    total = sum(len(g) for g in outcomes)
    failures = sum(o == "error" for g in outcomes for o in g)
    budget = int(max_exceptions * total) if isinstance(max_exceptions, float) else max_exceptions
    if failures > budget:
        # No budget at all: the rollout's own error, as ART raises it; a budget exceeded: named as such.
        expected = ValueError if max_exceptions == 0 else art.TooManyExceptionsError
        with pytest.raises(expected, match="the environment broke"):
            asyncio.run(gather())
        return
    groups = asyncio.run(gather())
    assert [len(g) for g in groups] == [g.count("ok") for g in outcomes]
    assert [len(g.exceptions) for g in groups] == [g.count("error") for g in outcomes]
    assert all("ValueError: the environment broke" in e for g in groups for e in g.exceptions)


def test_a_rollout_that_returns_something_else_is_named() -> None:
    async def wrong() -> Any:
        return {"reward": 1}

    with pytest.raises(TypeError, match="a rollout returned dict; rollouts must return art_nb.Trajectory"):
        asyncio.run(art.gather_trajectory_groups([art.TrajectoryGroup([wrong()])], pbar_desc=None, max_exceptions=10))


# ---- names -----------------------------------------------------------------------------------


names = st.one_of(
    text,
    st.sampled_from(["..", "../x", "a/../../b", "/etc", "a\\b", "~root", "a@1", ".hidden", "x" * 200, "ok-name",
                     "a..b", "a/b", "CON", "\u0441yrillic", "a\x00b", " lead", "trail "]),
)


@SETTINGS
@given(project=names, name=names, split=names)
def test_no_name_writes_outside_the_model_directory(project: str, name: str, split: str) -> None:
    with tempfile.TemporaryDirectory() as parent:
        root = Path(parent) / "root"
        root.mkdir()
        try:
            store = ModelStore(root, project, name)
            store.append_trajectories(split, 0, [{"reward": 1.0}])
            store.write_checkpoint(0, lambda d: (d / "adapter_config.json").write_text("{}"))
            store.append_history({"step": 0})
        except ValueError as error:
            assert "is not allowed" in str(error)
        written = [p for p in Path(parent).rglob("*")]
        assert all(p == root or root in p.parents for p in written), written
        for path in written:
            assert path.resolve().is_relative_to(root.resolve())


@SETTINGS
@given(name=names)
def test_models_reject_unsafe_names_at_construction(name: str) -> None:
    try:
        check_name("name", name)
        safe = True
    except ValueError:
        safe = False
    if safe:
        assert art.TrainableModel(name=name, base_model="b").name == name
        assert "/" not in name and ".." not in name and "\\" not in name and "@" not in name
    else:
        with pytest.raises(ValidationError, match="is not allowed"):
            art.TrainableModel(name=name, base_model="b")
        with pytest.raises(ValidationError, match="is not allowed"):
            art.TrainableModel(name="ok", project=name, base_model="b")


# ---- TrainConfig -------------------------------------------------------------------------------


float_fields = ["learning_rate", "epsilon", "epsilon_high", "max_grad_norm", "weight_decay"]
any_float = st.floats() | st.integers(-5, 5) | st.sampled_from([0.0, 1e300, -0.0])


@SETTINGS
@given(field=st.sampled_from(float_fields), value=any_float)
def test_train_config_rejects_unusable_numbers_naming_the_field(field: str, value: float) -> None:
    """A value is either rejected with the field's name, or the step can use it. Infinite clip
    ranges and grad norms mean "no clipping" and are usable."""
    try:
        config = art.TrainConfig(**{field: value})
    except ValidationError as error:
        assert field in str(error)
        return
    assert not math.isnan(getattr(config, field))
    assert 0 < config.learning_rate <= 1 and config.weight_decay >= 0 and config.max_grad_norm > 0


@SETTINGS
@given(betas=st.tuples(st.floats(), st.floats()), weight_decay=st.floats(min_value=0))
def test_train_config_rejects_betas_outside_0_1_and_infinite_weight_decay(betas, weight_decay) -> None:
    usable = all(0 <= b < 1 for b in betas) and math.isfinite(weight_decay)
    try:
        art.TrainConfig(adam_betas=betas, weight_decay=weight_decay)
    except ValidationError:
        assert not usable
        return
    assert usable, f"accepted adam_betas={betas}, weight_decay={weight_decay}"
