"""Property-based fuzz of the served OpenAPI document: no input yields a 5xx.

Schemathesis generates valid and invalid requests for every operation in
/openapi.json and sends them to a real server. The server runs with a 64-token
context, so that any generated request finishes quickly: the fuzz is bounded by the
number of examples, not by how much the fuzzer asks the model to generate.

(The strategies are driven with plain Hypothesis `@given` rather than schemathesis'
pytest loader, whose lazy-fixture support does not run on pytest 9.)
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

MAX_EXAMPLES = 25


def _operations(fuzz_server) -> list:
    schema = schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_yields_a_server_error(fuzz_server, mode: GenerationMode) -> None:
    operations = _operations(fuzz_server)
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not operation.body:
            continue  # GET routes without parameters have no invalid input to make

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.as_curl_command(), response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert error["code"] == response.status_code and error["message"]

        check()
    assert fuzz_server.async_llm.get_stats_sync() is not None  # the engine is still alive
