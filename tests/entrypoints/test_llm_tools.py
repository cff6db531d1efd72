"""`LLM.chat(tools=...)`: the tools reach the chat template, and a named call can be
enforced offline with a JSON schema from the tool's parameters."""

from __future__ import annotations

import json
from pathlib import Path

from decodegraph import LLM, SamplingParams
from decodegraph.sampling_params import StructuredOutputsParams

TEMPLATE = (
    "{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
)
PARAMS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": PARAMS}}]


def test_chat_passes_tools_to_the_template_and_follows_their_schema(stories_dir: Path) -> None:
    llm = LLM(
        str(stories_dir),
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=2,
        structured_outputs_config={"disable_any_whitespace": True},
    )
    messages = [{"role": "user", "content": "What time is it?"}]
    params = SamplingParams(
        temperature=1.0,
        seed=0,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(json=PARAMS),
    )
    out = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE, tools=TOOLS)[0]
    assert out.prompt.startswith("tools: get_time\n")
    assert json.loads(out.outputs[0].text)["zone"] in ("UTC", "CET")
