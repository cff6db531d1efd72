"""Structured outputs: a request's output follows a JSON schema, regex, choice or grammar."""

from decodegraph.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
