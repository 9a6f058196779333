"""Chat templates render as transformers renders them (``pdserve.chat_template``).

Every template of the test models (the built-in models' and SmolLM2's) and the templates in
``tests/data/chat_templates`` (written for these tests in the shapes of current model families:
Hermes/Qwen2 tools, Llama 3 JSON tools with ``strftime_now`` and ``raise_exception``, Mistral
alternation with loop controls and ``{% generation %}``, a retrieval template with
``documents``) is rendered for several conversations by pdserve's ``Tokenizer`` and by
``transformers.AutoTokenizer.apply_chat_template(..., tokenize=False)``: the text must be
identical, and a template that refuses a conversation must refuse it in both.
"""

from __future__ import annotations

import functools
import json
import lzma
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers

from pdserve.models import builtin
from pdserve.tokenizer import Tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
TEMPLATES = sorted((DATA / "chat_templates").glob("*.jinja"))
SMOLLM2_TEMPLATE = (  # SmolLM2-135M-Instruct's chat_template.jinja, as make_smollm2.sh writes it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city, now.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "Ville (accents ok)"},
        "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "noop", "description": "Does <nothing> & more.",
                                      "parameters": {"type": "object", "properties": {}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}}
DOCUMENTS = [{"title": "Blocks", "text": "A block holds 16 tokens."},
             {"title": "Caches", "text": "Prefix hits skip <compute>."}]

CONVERSATIONS: dict[str, dict[str, Any]] = {
    "plain": {"messages": [{"role": "user", "content": "Hi there"}]},
    "system-multi-turn": {"messages": [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "Two."}, {"role": "user", "content": "Three?"}]},
    "no-generation-prompt": {"messages": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello"}],
                             "add_generation_prompt": False},
    "tools": {"messages": [{"role": "user", "content": "Weather in Zürich?"}], "tools": TOOLS},
    "tool-call-and-result": {"messages": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}],
        "tools": TOOLS},
    "documents": {"messages": [{"role": "user", "content": "How big is a block?"}],
                  "documents": DOCUMENTS},
    "bad-alternation": {"messages": [{"role": "user", "content": "a"},
                                     {"role": "user", "content": "b"}]},
}


def _model_dir(root: Path, name: str, template: str) -> Path:
    """A tokenizer folder (SmolLM2's vocabulary) carrying ``template``."""
    path = root / name
    path.mkdir()
    with lzma.open(DATA / "smollm2-tokenizer.json.xz") as f:
        (path / "tokenizer.json").write_bytes(f.read())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    dirs = {t.stem: _model_dir(root, t.stem, t.read_text()) for t in TEMPLATES}
    dirs["smollm2"] = _model_dir(root, "smollm2", SMOLLM2_TEMPLATE)
    tiny = root / "tiny"
    builtin.save_builtin("tiny", tiny)
    dirs["builtin-tiny"] = tiny
    return dirs


@functools.cache
def _tokenizers(path: Path) -> tuple[Tokenizer, Any]:
    return Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(str(path))


def _render_both(path: Path, conv: dict[str, Any]) -> tuple[str | type, str | type]:
    ours, theirs = _tokenizers(path)
    kwargs = {k: v for k, v in conv.items() if k != "messages"}
    kwargs.setdefault("add_generation_prompt", True)
    try:
        mine: str | type = ours.apply_chat_template(conv["messages"], **kwargs)
    except ValueError:
        mine = ValueError
    try:
        ref: str | type = theirs.apply_chat_template(conv["messages"], tokenize=False, **kwargs)
    except jinja2.TemplateError:
        ref = ValueError
    return mine, ref


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("template", [t.stem for t in TEMPLATES] + ["smollm2", "builtin-tiny"])
def test_rendering_equals_transformers(model_dirs: dict[str, Path], template: str,
                                       conversation: str) -> None:
    conv = CONVERSATIONS[conversation]
    needs_tool_fields = {"tool-call-and-result"}
    if conversation in needs_tool_fields and template in ("smollm2", "builtin-tiny",
                                                          "rag_documents"):
        conv = {**conv, "messages": conv["messages"][:1]}  # content-only templates
    mine, ref = _render_both(model_dirs[template], conv)
    assert mine == ref


def test_the_family_templates_exercise_what_they_claim(model_dirs: dict[str, Path]) -> None:
    """Guards the comparison above against templates that render nothing interesting."""
    def render(name: str, conv: str) -> str | type:
        return _render_both(model_dirs[name], CONVERSATIONS[conv])[0]

    assert '"name": "get_weather", "arguments": {"city": "Zürich"' in str(
        render("hermes_tools", "tool-call-and-result"))
    assert "Today Date: " in str(render("llama3_json_tools", "tools"))
    assert render("mistral_alternating", "bad-alternation") is ValueError
    assert render("llama3_json_tools", "bad-alternation") is not ValueError
    assert "title: Caches" in str(render("rag_documents", "documents"))
    assert '"description": "Does <nothing> & more."' in str(render("mistral_alternating",
                                                                   "tools"))


def test_a_tool_use_template_is_taken_with_tools(tmp_path: Path) -> None:
    path = _model_dir(tmp_path, "named", "")
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "plain:{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "tools:{{ tools | length }}"}]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(path)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "plain:x"
    assert tok.apply_chat_template(messages, tools=TOOLS) == "tools:2"
    shutil.rmtree(path)
