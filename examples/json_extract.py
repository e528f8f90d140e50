"""Constrained JSON: the reply is a document valid against the schema, by construction.

Run: .venv/bin/python examples/json_extract.py
"""

import json

from mlxcache import SamplingParams, open_engine
from mlxcache.modes import json_mode

schema = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
engine = open_engine()
task = json_mode.JsonTask.create(schema)
reply = json_mode.run_one(
    engine, task, "Which city is the capital of Italy?", SamplingParams(max_tokens=24)
)
print(json.dumps(reply.output), reply.finish_reason)
