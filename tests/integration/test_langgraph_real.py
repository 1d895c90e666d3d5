"""ART's LangGraph helpers on the real tiny model (CPU): agents whose chat model comes from
`init_chat_model`, run as `wrap_rollout(model, rollout)` for a group, as ART's examples write them.
Every call an agent made is in its trajectory, training takes exactly the ids the engine sampled
(nothing re-tokenised, no template fallback), and a step trains.

Three agents: ART's shape (a ReAct agent with one tool, which SmolLM2-135M never calls unforced); a
two-call StateGraph whose tool runs as a graph node; and a ReAct agent forced to call its tool on
the first turn, so the trajectory holds a tool call, its result and the reply to it."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, TypedDict

import openai
import pytest

import art_nb as art
from art_nb.grpo.tokens import tokenize_trajectory
from art_nb.langgraph import init_chat_model, wrap_rollout

pytest.importorskip("langgraph")
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langgraph.graph import END, START, StateGraph  # noqa: E402
from langgraph.graph.message import add_messages  # noqa: E402
from langgraph.prebuilt import create_react_agent  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.long, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

TINY = "HuggingFaceTB/SmolLM2-135M-Instruct"
SYSTEM = "You answer with a tool call when a tool can help. Call get_weather for weather questions."
CITIES = ["Paris", "Lima", "Oslo"]


def weather_tool(called: list[str]) -> Any:
    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"21 C and sunny in {city}"

    return get_weather


def question(city: str) -> dict[str, Any]:
    return {"messages": [SystemMessage(content=SYSTEM), HumanMessage(content=f"What is the weather in {city}?")]}


def run_config() -> dict[str, Any]:
    return {"configurable": {"thread_id": str(uuid.uuid4())}, "recursion_limit": 6}


async def react_rollout(model: art.TrainableModel, city: str, force_tool: bool = False) -> art.Trajectory:
    """ART's LangGraph rollout shape: build the trajectory, run the agent, score, return it."""
    traj = art.Trajectory(reward=0.0, messages_and_choices=[], metadata={"city": city})
    called: list[str] = []
    get_weather = weather_tool(called)
    chat_model = init_chat_model(model.get_inference_name(), temperature=1.0, max_tokens=40)

    def pick(state: dict[str, Any], runtime: Any) -> Any:  # the first turn must call the tool, later ones may
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return chat_model.bind_tools([get_weather], tool_choice="auto" if answered else "get_weather")

    agent = create_react_agent(pick if force_tool else chat_model, [get_weather])
    try:
        await agent.ainvoke(question(city), config=run_config())
    except openai.BadRequestError:
        raise  # the endpoint refused the request: the test says why
    except Exception as error:  # noqa: BLE001 - ART's examples log a failed run and keep its calls
        traj.log(f"agent stopped: {type(error).__name__}: {error}")
    traj.reward = float(bool(called)) + 0.01 * len(city)  # rewards differ within the group
    traj.metrics["tool_called"] = bool(called)
    return traj


class State(TypedDict):
    messages: Annotated[list[Any], add_messages]
    city: str


async def graph_rollout(model: art.TrainableModel, city: str) -> None:
    """A two-call StateGraph: the model drafts, a node runs the tool, the model answers with its result.
    It returns nothing: its reward goes to `art.current_trajectory()`, which `wrap_rollout` returns."""
    chat_model = init_chat_model(model, max_tokens=24)  # the model itself, not a name: works anywhere
    called: list[str] = []
    get_weather = weather_tool(called)

    async def ask(state: State) -> dict[str, Any]:
        return {"messages": [await chat_model.ainvoke(state["messages"])]}

    def look_up(state: State) -> dict[str, Any]:
        result = get_weather.invoke({"city": state["city"]})
        return {"messages": [HumanMessage(content=f"The weather service says: {result}. Answer in one sentence.")]}

    graph = StateGraph(State)
    graph.add_node("draft", ask)
    graph.add_node("look_up", look_up)
    graph.add_node("answer", ask)
    graph.add_edge(START, "draft")
    graph.add_edge("draft", "look_up")
    graph.add_edge("look_up", "answer")
    graph.add_edge("answer", END)
    final = await graph.compile().ainvoke({**question(city), "city": city}, config=run_config())
    answer = str(final["messages"][-1].content)
    art.current_trajectory(required=True).reward = float("sunny" in answer) + 0.01 * len(city)


@pytest.fixture(scope="module")
async def served(tmp_path_factory):
    backend = art.LocalBackend(path=tmp_path_factory.mktemp("art"))
    model = art.TrainableModel(name="lg", project="it", base_model=TINY,
                               config=art.ModelConfig(max_seq_len=2048, lora=art.LoraConfig(rank=8, alpha=32)))
    await model.register(backend)
    yield backend, model
    await backend.close()


def check_trained_ids(backend: art.LocalBackend, model: art.TrainableModel, group: art.TrajectoryGroup) -> None:
    """Each trajectory trains on exactly the ids the engine sampled, in the order it sampled them."""
    tokenizer = backend._runtime.state(model).trainer.tokenizer  # what training tokenises with
    for traj in group.trajectories:
        assert traj.exchanges, f"the agent's calls were not recorded: {traj.logs}"
        assert traj.messages_and_choices == []
        seq = tokenize_trajectory(tokenizer, traj, 2048)
        assert seq.retokenized_choices == 0 and seq.template_fallbacks == 0
        sampled = [i for call in traj.exchanges for i in call.choices[0].token_ids]
        assert [i for i, m in zip(seq.input_ids, seq.assistant_mask, strict=True) if m] == sampled


async def test_langgraph_agents_train_on_the_ids_the_engine_sampled(served) -> None:
    backend, model = served
    react, graph = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(wrap_rollout(model, react_rollout)(model, city) for city in CITIES),
         art.TrajectoryGroup(wrap_rollout(model, graph_rollout)(model, city) for city in CITIES)], max_exceptions=0)
    for traj in react:
        assert traj.metadata["city"] in CITIES  # the rollout's own trajectory came back, with the calls
        assert {t["function"]["name"] for t in traj.exchanges[0].request["tools"]} == {"get_weather"}
        assert traj.messages()[1]["content"].startswith("What is the weather")
    for traj in graph:
        assert len(traj.exchanges) == 2  # draft, then the answer to the tool's result
        assert "The weather service says: 21 C" in traj.messages()[-2]["content"]
        assert traj.sampled()[-1] and traj.sampled()[2]  # both replies are the model's, as sampled
    for group in (react, graph):
        check_trained_ids(backend, model, group)
    print(f"\nReAct: tool called {[t.metrics['tool_called'] for t in react]}; "
          f"StateGraph rewards {[round(t.reward, 2) for t in graph]}")
    result = await model.train([react, graph], config=art.TrainConfig(learning_rate=1e-4))
    assert result.step == 1 and result.metrics["retokenized_choices"] == 0
    assert model.get_inference_name().endswith("@1")


async def test_a_forced_tool_call_and_its_result_train_exactly(served) -> None:
    backend, model = served
    (group,) = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(wrap_rollout(model, react_rollout)(model, city, force_tool=True) for city in CITIES)],
        max_exceptions=0)
    for traj in group:
        assert traj.metrics["tool_called"] and len(traj.exchanges) >= 2
        assert any(m["role"] == "tool" and "21 C and sunny" in m["content"] for m in traj.messages())
    check_trained_ids(backend, model, group)
    step = (await model.train([group], config=art.TrainConfig(learning_rate=1e-4))).step
    assert step == await model.get_step()
