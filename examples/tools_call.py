"""A forced tool call (tool_choice required), parsed and checked against the tool's schema.

Run: .venv/bin/python examples/tools_call.py
"""

from mlxcache import SamplingParams, open_engine
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tools import ToolChoice, parse_tools

tools = parse_tools(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24}},
                    "required": ["city"],
                },
            },
        }
    ]
)
engine = open_engine()
task = ToolsTask(tools, ToolChoice.parse("required", tools))
ids = task.encode(engine, [{"role": "user", "content": "What is the weather in Paris?"}])
reply = task.read(engine.complete(task.request(engine, ids, SamplingParams(max_tokens=32))))
for call in reply.calls:
    print(call.as_dict())
