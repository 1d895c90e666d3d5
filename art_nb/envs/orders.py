"""A shop's orders in SQLite, three lookup tools over them, questions with known answers, and the checker.

The environment of the tool-agent notebook, kept free of any agent framework so that LangGraph, the
Agents SDK or plain `model.openai_client()` code can all drive it, and so that tests check it in
milliseconds. Everything is made from a seed: the same database, the same questions, the same answers.

The database (stdlib `sqlite3`, in memory, one per `Session`) has three tables: `customers` (id,
name, city), `orders` (id, customer_id, placed_on, status, total) and `items` (order_id, product,
quantity, price). A `Session` is one rollout's view of it: three tools, each taking one argument and
returning a short text, every call recorded with what it showed:

- `find_customer(name)`: customers whose name contains the text, with their id and city;
- `list_orders(customer_id)`: a customer's orders (number, date, status, total), oldest first;
- `get_order(order_id)`: one order's customer, date, status, items and total.

A question (`tasks()`) is one of five kinds; three take one lookup, two take a customer's id first:

| kind | question | answered by |
|---|---|---|
| status | What is the status of order 1042? | get_order(1042) |
| total | What was the total of order 1042? | get_order(1042) |
| city | Which city does Maria Lopez live in? | find_customer("Maria Lopez") |
| count | How many orders has Maria Lopez placed? | find_customer, then list_orders(7) |
| latest | What is the status of Maria Lopez's latest order? | find_customer, then list_orders(7) |

`demonstration(task)` is a perfect run as OpenAI chat messages (the calls above, their real
results, the answer): supervised data that shows a small model the call format before GRPO.

The agent answers in its last message as `<answer>...</answer>`. `score` grades a rollout by code,
with partial credit so that a small model that rarely gets everything right still sees rewards
that differ within a group (GRPO learns from nothing else):

    0.2  a valid tool call (a known tool, arguments of the right type: it ran)
    0.2  the right lookup (the call whose result holds the answer: get_order of that order,
         list_orders of that customer, find_customer showing that customer)
    0.1  an answer in <answer></answer> tags
    0.5  the right answer after the right lookup (numbers compared as numbers, words
         case-insensitively); a right guess earns nothing here: with four statuses, guessing
         "delivered" would pay a quarter of the time, and a small model learns that first
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ANSWER_FORMAT",
    "KINDS",
    "REWARD_PARTS",
    "Score",
    "Session",
    "ToolCall",
    "build_database",
    "demonstration",
    "parse_answer",
    "score",
    "tasks",
]

KINDS = ("status", "total", "city", "count", "latest")
STATUSES = ("processing", "shipped", "delivered", "cancelled")
REWARD_PARTS = {"valid_call": 0.2, "right_lookup": 0.2, "answered": 0.1, "correct": 0.5}
"""Each part's share of the reward (they sum to 1): what `score` adds up."""
ANSWER_FORMAT = "<answer>...</answer>"

_FIRST = ("Maria", "James", "Aiko", "Omar", "Lena", "Tomas", "Priya", "Kofi", "Elena", "Wei",
          "Sofia", "Noah", "Amara", "Lucas", "Ingrid", "Mateo", "Yuki", "Hannah", "Ravi", "Chloe")
_LAST = ("Lopez", "Smith", "Tanaka", "Haddad", "Novak", "Berg", "Patel", "Mensah", "Rossi", "Chen",
         "Costa", "Weber", "Okafor", "Martin", "Larsen", "Silva", "Sato", "Fischer", "Iyer", "Dubois")
_CITIES = ("Lyon", "Osaka", "Leeds", "Porto", "Bergen", "Austin", "Pune", "Accra", "Turin", "Graz")
_PRODUCTS = (("mug", 8.5), ("notebook", 4.25), ("lamp", 32.0), ("kettle", 27.9), ("scarf", 15.0),
             ("backpack", 49.99), ("headphones", 79.0), ("candle", 6.75))
_FIRST_ORDER = 1001
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL | re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def build_database(seed: int = 0, customers: int = 20, orders: int = 60) -> sqlite3.Connection:
    """A new in-memory database with `customers` and `orders` made from `seed` (the same seed, the same rows).

    `check_same_thread=False`: agent frameworks run synchronous tools in worker threads. Each
    `Session` opens its own, so no connection is shared between rollouts."""
    rng = random.Random(seed)
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.executescript("""
        CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL);
        CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                             placed_on TEXT NOT NULL, status TEXT NOT NULL, total REAL NOT NULL);
        CREATE TABLE items (order_id INTEGER NOT NULL REFERENCES orders(id), product TEXT NOT NULL,
                            quantity INTEGER NOT NULL, price REAL NOT NULL);
    """)
    names = [f"{first} {last}" for first, last in zip(_FIRST, _LAST)][:customers]
    db.executemany("INSERT INTO customers VALUES (?, ?, ?)",
                   [(i + 1, name, rng.choice(_CITIES)) for i, name in enumerate(names)])
    for number in range(_FIRST_ORDER, _FIRST_ORDER + orders):
        lines = [(product, rng.randint(1, 3), price) for product, price in rng.sample(_PRODUCTS, rng.randint(1, 3))]
        total = round(sum(quantity * price for _, quantity, price in lines), 2)
        placed = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        db.execute("INSERT INTO orders VALUES (?, ?, ?, ?, ?)",
                   (number, rng.randint(1, len(names)), placed, rng.choice(STATUSES), total))
        db.executemany("INSERT INTO items VALUES (?, ?, ?, ?)", [(number, *line) for line in lines])
    db.commit()
    return db


def tasks(seed: int = 0) -> list[dict[str, Any]]:
    """Every question about the database of `seed`, as JSON-able rows (a `datasets.Dataset` takes them).

    Each row: `id`, `kind`, `question`, `answer` (a string), `lookup` (the call whose result holds
    the answer, e.g. "get_order:1042") and `seed`. Customers without orders get no count/latest question."""
    db = build_database(seed)
    rows: list[dict[str, Any]] = []

    def add(kind: str, question: str, answer: Any, lookup: str) -> None:
        rows.append({"id": f"{kind}-{len(rows)}", "kind": kind, "question": question, "answer": str(answer),
                     "lookup": lookup, "seed": seed})

    for number, status, total in db.execute("SELECT id, status, total FROM orders ORDER BY id"):
        add("status", f"What is the status of order {number}?", status, f"get_order:{number}")
        add("total", f"What was the total of order {number}?", f"{total:.2f}", f"get_order:{number}")
    for customer, name, city in db.execute("SELECT id, name, city FROM customers ORDER BY id").fetchall():
        add("city", f"Which city does {name} live in?", city, f"find_customer:{customer}")
        placed = db.execute("SELECT status FROM orders WHERE customer_id = ? ORDER BY placed_on, id",
                            (customer,)).fetchall()
        if placed:
            add("count", f"How many orders has {name} placed?", len(placed), f"list_orders:{customer}")
            add("latest", f"What is the status of {name}'s latest order?", placed[-1][0], f"list_orders:{customer}")
    db.close()
    return rows


@dataclass(frozen=True)
class ToolCall:
    """One call a tool ran: its name and argument, the text it returned, and the lookups it showed
    ("get_order:1042", "find_customer:7"...), which `score` compares with the task's `lookup`."""

    name: str
    argument: Any
    result: str
    shown: tuple[str, ...]


@dataclass
class Session:
    """One rollout's database and tools. `tools()` are plain methods (typed, documented) that agent
    frameworks turn into tools as they are (LangChain's `tool`, the Agents SDK's `function_tool`)."""

    seed: int = 0
    calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._db = build_database(self.seed)

    def tools(self) -> list[Callable[..., str]]:
        return [self.find_customer, self.list_orders, self.get_order]

    def close(self) -> None:
        self._db.close()

    def find_customer(self, name: str) -> str:
        """Find customers whose name contains the given text. Returns each one's customer id, name and city."""
        text = str(name).strip()
        rows = self._db.execute("SELECT id, name, city FROM customers WHERE instr(lower(name), lower(?)) > 0 "
                                "ORDER BY id LIMIT 5", (text,)).fetchall() if text else []
        result = "\n".join(f"customer {i}: {n}, {c}" for i, n, c in rows) or f"no customer matches {text!r}"
        return self._record("find_customer", name, result, [f"find_customer:{i}" for i, _, _ in rows])

    def list_orders(self, customer_id: int) -> str:
        """List a customer's orders, oldest first: order number, date, status and total."""
        rows = self._db.execute("SELECT id, placed_on, status, total FROM orders WHERE customer_id = ? "
                                "ORDER BY placed_on, id", (customer_id,)).fetchall()
        known = self._db.execute("SELECT 1 FROM customers WHERE id = ?", (customer_id,)).fetchone() is not None
        if rows:
            result = "\n".join(f"order {i}: {d}, {s}, total {t:.2f}" for i, d, s, t in rows)
        else:
            result = f"customer {customer_id} has no orders" if known else f"no customer {customer_id}"
        return self._record("list_orders", customer_id, result, [f"list_orders:{customer_id}"] if known else [])

    def get_order(self, order_id: int) -> str:
        """Look up one order by its number: customer, date, status, items and total."""
        row = self._db.execute("SELECT o.id, c.id, c.name, o.placed_on, o.status, o.total FROM orders o "
                               "JOIN customers c ON c.id = o.customer_id WHERE o.id = ?", (order_id,)).fetchone()
        if row is None:
            return self._record("get_order", order_id, f"no order {order_id}", [])
        items = self._db.execute("SELECT quantity, product FROM items WHERE order_id = ? ORDER BY rowid",
                                 (order_id,)).fetchall()
        number, customer, name, placed, status, total = row
        result = (f"order {number}: customer {customer} ({name}), placed {placed}, status {status}, "
                  f"total {total:.2f}; items: " + ", ".join(f"{q} x {p}" for q, p in items))
        return self._record("get_order", order_id, result, [f"get_order:{number}"])

    def _record(self, name: str, argument: Any, result: str, shown: list[str]) -> str:
        self.calls.append(ToolCall(name, argument, result, tuple(shown)))
        return result


def demonstration(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A perfect agent run on `task` as OpenAI chat messages: the question, each tool call (an
    assistant message with `tool_calls`) and its result (a `tool` message, the tool's real text), then
    the answer in tags. The calls are the ones the module docstring's table names for the task's kind."""
    session = Session(seed=task["seed"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]

    def call(tool: Callable[..., str], argument: str, value: Any) -> None:
        call_id = f"call_{len(messages)}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": call_id, "type": "function",
            "function": {"name": tool.__name__, "arguments": json.dumps({argument: value})}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": tool(value)})

    key = int(task["lookup"].split(":")[1])
    if task["kind"] in ("status", "total"):
        call(session.get_order, "order_id", key)
    else:
        name = session._db.execute("SELECT name FROM customers WHERE id = ?", (key,)).fetchone()[0]
        call(session.find_customer, "name", name)
        if task["kind"] in ("count", "latest"):
            call(session.list_orders, "customer_id", key)
    messages.append({"role": "assistant", "content": f"<answer>{task['answer']}</answer>"})
    session.close()
    return messages


@dataclass(frozen=True)
class Score:
    """A rollout's reward and its parts (each 0 or 1), plus right guesses and how many tool calls ran."""

    reward: float
    metrics: dict[str, float]


def parse_answer(reply: str | None) -> str | None:
    """The text inside the last `<answer></answer>` of `reply`, or None when there is none."""
    found = _ANSWER.findall(reply or "")
    return found[-1] if found else None


def _same(answer: str, expected: str) -> bool:
    if _NUMBER.fullmatch(expected):
        numbers = _NUMBER.findall(answer.replace(",", ""))
        return len(numbers) == 1 and abs(float(numbers[0]) - float(expected)) < 0.005
    return re.sub(r"[^a-z ]", "", answer.lower()).strip() == expected.lower()


def score(task: dict[str, Any], calls: list[ToolCall], reply: str | None) -> Score:
    """Grade one rollout of `task` from the tool calls that ran and the agent's last message (see the
    module docstring for the parts). `guessed` (a metric, not rewarded) counts right answers given
    without the lookup."""
    answer = parse_answer(reply)
    looked_up = any(task["lookup"] in call.shown for call in calls)
    right = answer is not None and _same(answer, str(task["answer"]))
    parts = {
        "valid_call": float(bool(calls)),
        "right_lookup": float(looked_up),
        "answered": float(answer is not None),
        "correct": float(right and looked_up),
    }
    reward = round(sum(REWARD_PARTS[name] * value for name, value in parts.items()), 6)
    return Score(reward, {**parts, "guessed": float(right and not looked_up), "tool_calls": float(len(calls))})
