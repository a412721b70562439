"""A schema-driven fuzz run (schemathesis) of the app's own OpenAPI document: no 5xx, ever."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from deployments.front.ingress import api

schema = schemathesis.openapi.from_dict(api.openapi())
# Output lengths are capped so each example is quick: the model never ends a reply by itself
# here, and the limits of max_tokens are checked by the validation tests.
MAX_FUZZ_TOKENS = 8


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, stack):
    fields = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
              "/v1/completions": ("max_tokens",), "/v1/responses": ("max_output_tokens",)}.get(case.path, ())
    if isinstance(case.body, dict) and fields:
        # Mostly the served model, so requests get past the model check and reach the workers.
        case.body["model"] = stack.model
        for field in fields:
            if isinstance(case.body.get(field), int) and case.body[field] > MAX_FUZZ_TOKENS:
                case.body[field] = MAX_FUZZ_TOKENS
        if all(case.body.get(field) is None for field in fields):
            case.body[fields[0]] = MAX_FUZZ_TOKENS
    response = case.call(base_url=stack.base_url, timeout=120)
    where = f"{case.method} {case.formatted_path}"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["code"] and "param" in error
