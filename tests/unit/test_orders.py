"""The tool-agent environment (art_nb.envs.orders): the database, the tools, the questions and the checker.

The strongest check is the scripted agent: it answers every question by calling the tools the way
the module docstring says and reading their text, and must score 1.0 on all of them, so each
question's answer is reachable through the tools and the checker agrees with what they show."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter

import pytest

from art_nb.envs import orders


def scripted_agent(task: dict) -> tuple[orders.Session, str]:
    """Answer `task` through the tools alone, as a perfect agent would; returns the session and reply."""
    session = orders.Session(seed=task["seed"])
    question = task["question"]
    if task["kind"] in ("status", "total"):
        text = session.get_order(int(re.search(r"order (\d+)", question).group(1)))
        pattern = r"status (\w+)" if task["kind"] == "status" else r"total ([\d.]+)"
        answer = re.search(pattern, text).group(1)
    else:
        name = re.search(r"(?:does|has|of) ([A-Z]\w+ [A-Z]\w+)", question).group(1)
        found = session.find_customer(name)
        customer_id, city = re.fullmatch(r"customer (\d+): [^,]+, (\w+)", found).groups()
        if task["kind"] == "city":
            answer = city
        else:
            lines = session.list_orders(int(customer_id)).splitlines()
            answer = str(len(lines)) if task["kind"] == "count" else re.search(r", (\w+), total", lines[-1]).group(1)
    return session, f"<answer>{answer}</answer>"


def test_every_question_is_answerable_through_the_tools_and_scores_one():
    rows = orders.tasks()
    for task in rows:
        session, reply = scripted_agent(task)
        result = orders.score(task, session.calls, reply)
        assert result.reward == 1.0, (task, session.calls, reply)
        assert result.metrics["right_lookup"] == 1.0
        session.close()


def test_a_demonstration_replayed_through_the_tools_scores_one():
    """Each demonstration's calls, run again on a fresh session, return the results it shows, and the
    run it describes is a perfect one by the checker."""
    for task in orders.tasks():
        messages = orders.demonstration(task)
        assert messages[0] == {"role": "user", "content": task["question"]}
        session = orders.Session(seed=task["seed"])
        for sent, result in zip(messages[1:-1:2], messages[2:-1:2]):
            (call,) = sent["tool_calls"]
            assert result == {"role": "tool", "tool_call_id": call["id"], "content": result["content"]}
            (value,) = json.loads(call["function"]["arguments"]).values()
            assert getattr(session, call["function"]["name"])(value) == result["content"]
        assert orders.score(task, session.calls, messages[-1]["content"]).reward == 1.0
        assert len(session.calls) == (1 if task["kind"] in ("status", "total", "city") else 2)


def test_the_questions_cover_every_kind_with_unique_ids_and_questions():
    rows = orders.tasks()
    kinds = Counter(row["kind"] for row in rows)
    assert set(kinds) == set(orders.KINDS)
    assert kinds["status"] == kinds["total"] == 60 and kinds["city"] == 20
    assert len({row["id"] for row in rows}) == len({row["question"] for row in rows}) == len(rows)
    assert all(isinstance(row["answer"], str) and row["answer"] for row in rows)  # one column type for datasets
    assert len({row["answer"] for row in rows if row["kind"] == "status"}) == len(orders.STATUSES)


def test_the_same_seed_builds_the_same_database_and_another_seed_does_not():
    def dump(db):
        tables = ("customers", "orders", "items")
        return [db.execute(f"SELECT * FROM {table} ORDER BY rowid").fetchall() for table in tables]

    assert dump(orders.build_database(0)) == dump(orders.build_database(0))
    assert dump(orders.build_database(0)) != dump(orders.build_database(1))
    assert orders.tasks(0) == orders.tasks(0) and orders.tasks(0) != orders.tasks(1)
    db = orders.build_database(0)
    totals = db.execute("SELECT o.total, round(sum(i.quantity * i.price), 2) FROM orders o "
                        "JOIN items i ON i.order_id = o.id GROUP BY o.id").fetchall()
    assert len(totals) == 60 and all(total == computed for total, computed in totals)


@pytest.mark.parametrize("calls, reply, reward", [
    ([], None, 0.0),  # said nothing usable
    ([], "<answer>delivered</answer>", 0.1),  # the format only (the task's answer is not "delivered")
    ([("get_order", 1002)], "it is shipped", 0.2),  # a call that ran, the wrong order, no tags
    ([("get_order", 1001)], "<answer>shipped</answer>", 0.5),  # looked up the right order, answered wrong
    ([], "<answer>Processing.</answer>", 0.1),  # right without looking: a guess earns the format only
    ([("get_order", 1002)], "<answer>processing</answer>", 0.3),  # another order looked up: still a guess
    ([("find_customer", "Maria"), ("get_order", 1001)], "<answer>processing</answer>", 1.0),
])
def test_partial_credit(calls, reply, reward):
    task = next(t for t in orders.tasks() if t["id"] == "status-0")
    assert task["answer"] == "processing" and task["lookup"] == "get_order:1001"
    session = orders.Session()
    for name, argument in calls:
        getattr(session, name)(argument)
    result = orders.score(task, session.calls, reply)
    assert result.reward == pytest.approx(reward)
    assert result.reward == pytest.approx(sum(orders.REWARD_PARTS[k] * result.metrics[k] for k in orders.REWARD_PARTS))
    assert result.metrics["tool_calls"] == len(calls)
    assert result.metrics["guessed"] == float(reward in (0.1, 0.3) and "rocessing" in (reply or ""))


@pytest.mark.parametrize("answer, correct", [
    ("128.25", True), ("$128.25", True), ("128.250", True), ("1,128.25", False), ("128.2", False),
    ("128", False), ("128.25 or 12.00", False), ("about 128.25 dollars", True), ("", False),
])
def test_numbers_are_compared_as_numbers(answer, correct):
    task = {"answer": "128.25", "lookup": "get_order:1001"}
    looked_up = [orders.ToolCall("get_order", 1001, "order 1001: ...", ("get_order:1001",))]
    assert orders.score(task, looked_up, f"<answer>{answer}</answer>").metrics["correct"] == float(correct)
    assert orders.score(task, [], f"<answer>{answer}</answer>").metrics["guessed"] == float(correct)


def test_parse_answer_takes_the_last_tagged_answer():
    assert orders.parse_answer("<answer>a</answer> then <ANSWER>\n b \n</ANSWER>") == "b"
    assert orders.parse_answer("<answer>unclosed") is None and orders.parse_answer(None) is None


def test_tools_answer_unknown_input_in_words_and_show_nothing():
    session = orders.Session()
    assert session.get_order(5) == "no order 5"
    assert session.list_orders(99) == "no customer 99"
    assert session.find_customer("  ") == "no customer matches ''"
    assert session.find_customer("Zed") == "no customer matches 'Zed'"
    assert [call.shown for call in session.calls] == [(), (), (), ()]
    assert len(session.find_customer("a").splitlines()) == 5  # at most five matches
    assert session.find_customer("MARIA lo") == session.find_customer("maria")


def test_sessions_are_independent_and_their_tools_run_in_worker_threads():
    first, second = orders.Session(), orders.Session()

    async def lookups():  # as agent frameworks run synchronous tools
        return await asyncio.gather(*(asyncio.to_thread(first.get_order, 1000 + i) for i in range(1, 9)))

    results = asyncio.run(lookups())
    assert all(text.startswith(f"order {1000 + i}:") for i, text in enumerate(results, 1))
    assert len(first.calls) == 8 and second.calls == []


def test_the_tools_become_langchain_tools_as_they_are():
    tools = pytest.importorskip("langchain_core.tools")
    from langchain_core.utils.function_calling import convert_to_openai_tool

    session = orders.Session()
    specs = [convert_to_openai_tool(tools.tool(f))["function"] for f in session.tools()]
    assert [s["name"] for s in specs] == ["find_customer", "list_orders", "get_order"]
    assert specs[2]["parameters"]["properties"] == {"order_id": {"type": "integer"}}
    assert all(s["description"] for s in specs)
    assert tools.tool(session.get_order).invoke({"order_id": "1001"}).startswith("order 1001:")  # "1001" coerced
