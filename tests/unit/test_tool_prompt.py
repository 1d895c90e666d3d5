"""Tools reach every model (art_nb/tool_prompt.py): the template's own rendering where it shows tools,
calls as <tool_call> blocks and results, else the Hermes-style fallback; register says which, a request
whose tools the template drops is refused, and ModelConfig/ART's chat_template reach both tokenizers."""

from __future__ import annotations

import json

import pytest
from chat_templates import QWEN25_TEMPLATE
from conftest import CHATML_TEMPLATE, build_chatml_tokenizer

from art_nb.config import ModelConfig
from art_nb.local.server.pipeline import render_prompt
from art_nb.local.server.schema import ChatCompletionRequest
from art_nb.local.server.templates import apply_prompt_config
from art_nb.local.server.toolcalls import parse_tool_calls
from art_nb.porting import model_config
from art_nb.tool_prompt import hermes_messages, template_inputs, tool_style
from art_nb.web import ApiError

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
PLAIN = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # SmolLM2's kind: content only
LLAMA_JSON = PLAIN.replace("{{ m.content }}", "{{ m.content }}{% for c in m.tool_calls or [] %}{\"name\": "
                           "\"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}"
                           "{% if tools %}{{ tools | tojson }}{% endif %}")
NO_SYSTEM = ("{% for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
             "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "21 C"},
    {"role": "tool", "tool_call_id": "b", "content": "18 C"},
    {"role": "user", "content": "Thanks."},
]


@pytest.mark.parametrize(("template", "kind", "why"), [
    (QWEN25_TEMPLATE, "template", "own rendering"),
    (CHATML_TEMPLATE, "template", "own rendering"),  # tests/conftest's Qwen-style ChatML
    (PLAIN, "hermes", "does not show the tools list"),
    (LLAMA_JSON, "hermes", "does not write tool calls as <tool_call> JSON blocks"),
])
def test_the_style_follows_what_the_template_shows(template, kind, why) -> None:
    style = tool_style(build_chatml_tokenizer(template))
    assert style.kind == kind and why in style.reason


def test_the_fallback_writes_tools_calls_and_results_as_text_that_parses_back() -> None:
    shown = hermes_messages(CONVERSATION, TOOLS)
    assert [m["role"] for m in shown] == ["system", "user", "assistant", "user", "user"]
    assert shown[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(TOOLS[0]) in shown[0]["content"]
    assert "tool_calls" not in shown[2] and shown[2]["content"].startswith("Checking.\n<tool_call>\n")
    _, calls = parse_tool_calls(shown[2]["content"])  # what the model is shown is what the endpoint parses
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert shown[3]["content"] == "<tool_response>\n21 C\n</tool_response>\n<tool_response>\n18 C\n</tool_response>"
    assert hermes_messages([{"role": "user", "content": "hi"}], TOOLS)[0]["role"] == "system"  # one of its own


def test_a_template_that_shows_tools_gets_the_messages_unchanged() -> None:
    tok = build_chatml_tokenizer(QWEN25_TEMPLATE)
    assert template_inputs(tok, CONVERSATION, TOOLS) == (CONVERSATION, TOOLS)


def _request(**extra) -> ChatCompletionRequest:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": TOOLS, **extra})


def test_smollm2_like_templates_show_the_tools_in_the_prompt() -> None:
    tok = build_chatml_tokenizer(PLAIN)
    text = tok.decode(render_prompt(tok, _request()))
    assert "<|im_start|>system\nBe brief.\n\n# Tools" in text and '"name": "get_weather"' in text
    hidden = tok.decode(render_prompt(tok, _request(tool_choice="none")))
    assert "get_weather" not in hidden  # tool_choice="none" hides them, as OpenAI's does


def test_a_template_that_drops_the_tools_is_refused_naming_the_reason() -> None:
    tok = build_chatml_tokenizer(NO_SYSTEM)
    with pytest.raises(ApiError) as refused:
        render_prompt(tok, _request())
    assert refused.value.status == 400 and refused.value.param == "tools"
    assert "dropped the system message that lists the tools" in refused.value.message
    assert "ModelConfig(chat_template=...)" in refused.value.message
    render_prompt(tok, _request(tool_choice="none"))  # without tools it renders


def test_the_chat_template_reaches_both_tokenizers_and_register_says_which_tools_style() -> None:
    engine_tok, trainer_tok = build_chatml_tokenizer(PLAIN), build_chatml_tokenizer(PLAIN)
    config = ModelConfig(chat_template=QWEN25_TEMPLATE)
    reasons = apply_prompt_config(engine_tok, trainer_tok, config, "agent")
    assert engine_tok.chat_template == trainer_tok.chat_template == QWEN25_TEMPLATE
    assert "own rendering" in reasons["tools"] and "ids it sampled" in reasons["assistant_turns"]
    assert "ModelConfig.chat_template" in reasons["chat_template"]
    assert apply_prompt_config(engine_tok, None, config, "second")["tools"] == reasons["tools"]  # same: shared
    with pytest.raises(ValueError, match="'other'.*same three ModelConfig fields"):
        apply_prompt_config(engine_tok, None, ModelConfig(assistant_turns="rendered"), "other")
    fallback = apply_prompt_config(build_chatml_tokenizer(PLAIN), None, ModelConfig(), "plain")["tools"]
    assert "Hermes-style" in fallback and "does not show the tools list" in fallback


def test_arts_chat_template_and_its_path_map_onto_model_config(tmp_path) -> None:
    assert model_config(ModelConfig(), {"chat_template": "{{ x }}"}, None).chat_template == "{{ x }}"
    (tmp_path / "t.jinja").write_text("{{ y }}", encoding="utf-8")
    assert model_config(ModelConfig(), {"chat_template_path": str(tmp_path / "t.jinja")}, None).chat_template == "{{ y }}"
    with pytest.raises(ValueError, match="chat_template_path.*cannot be read"):
        model_config(ModelConfig(), {"chat_template_path": str(tmp_path / "missing.jinja")}, None)
