"""A constrained request the parallel tests share: its grammar bitmask must reach every rank."""

from rivulet import SamplingParams
from rivulet.sampling_params import StructuredOutputsParams

JSON_PROMPT = "A city as JSON:"
CITY = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                         "people": {"type": "integer", "minimum": 0}},
        "required": ["name", "people"], "additionalProperties": False}


def constrained_params() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=CITY))
