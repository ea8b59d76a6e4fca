"""Both REST services fuzzed from their own OpenAPI documents (schemathesis), bounded and seeded.

A manager (on real brokers) and a weight service run as processes with tokens set and
RLBOOST_EXPOSE=token, so the documents themselves sit behind the bearer token. Every operation
of each document gets a fixed number of generated requests (hypothesis, derandomized: the same
cases each run), sent with the right token; each response must not be a 5xx, and its status,
content type and body must be what the document declares. A document missing a status the
service answers (401, 404, 413, 422, 503, ...) fails here, as does any crash.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from rlboost.launcher import Child
from rlboost.stack import Stack
from shared.ports import free_port

TOKEN, WEIGHTS_TOKEN = "api-fuzz-token", "weights-fuzz-token"
EXAMPLES = 12  # per operation: ~20 operations, well under a minute for both services
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def _serve(name: str, module: str, env: dict[str, str], url: str, root: Path,
           token: str) -> Child:
    child = Child(name, [sys.executable, "-m", module], env, root / f"{name}.log")
    child.start()
    for _ in range(300):
        try:
            got = httpx.get(f"{url}/openapi.json", timeout=1,
                            headers={"Authorization": f"Bearer {token}"})
            if got.status_code == 200:
                return child
        except httpx.TransportError:
            pass
        if not child.alive():
            break
        time.sleep(0.05)
    pytest.fail(f"{name} did not come up:\n{child.tail()}")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    root = tmp_path_factory.mktemp("fuzz")
    stack = Stack.create(root / "brokers")
    stack.start()
    manager, weights = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    env = {**stack.env(), "RLBOOST_MANAGER_URL": manager, "RLBOOST_WEIGHTS_URL": weights,
           "RLBOOST_API_TOKEN": TOKEN, "RLBOOST_WEIGHTS_TOKEN": WEIGHTS_TOKEN,
           "RLBOOST_EXPOSE": "token", "RLBOOST_DATA_DIR": str(root / "data"),
           "RLBOOST_PARENT_PID": str(os.getpid())}
    children = [_serve("manager", "manager_svc", env, manager, root, TOKEN),
                _serve("weights", "weight_svc", env, weights, root, WEIGHTS_TOKEN)]
    try:
        yield {"manager": manager, "weights": weights}
    finally:
        for child in children:
            child.signal(15)
        for child in children:
            if child.proc is not None:
                child.proc.wait(timeout=15)
        stack.stop()


def _schema(url: str, token: str) -> Any:
    return schemathesis.openapi.from_url(f"{url}/openapi.json",
                                         headers={"Authorization": f"Bearer {token}"})


@pytest.fixture(scope="module")
def manager_schema(services: dict[str, str]) -> Any:
    return _schema(services["manager"], TOKEN)


@pytest.fixture(scope="module")
def weights_schema(services: dict[str, str]) -> Any:
    return _schema(services["weights"], WEIGHTS_TOKEN)


FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck), print_blob=False)


def fuzz(schema: Any, token: str) -> list[str]:
    """Every operation, EXAMPLES cases each; the failures, one line per operation."""
    failures, operations = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @FUZZ
        def run(case: Any) -> None:
            case.call_and_validate(headers={"Authorization": f"Bearer {token}"}, checks=CHECKS)

        try:
            run()
        except Exception as exc:
            failures.append(f"{operation.label}: {str(exc)[:600]}")
    assert operations >= 8  # the document was read
    return failures


def test_manager_api_conforms_to_its_document(manager_schema: Any) -> None:
    failures = fuzz(manager_schema, TOKEN)
    assert not failures, "\n".join(failures)


def test_weight_api_conforms_to_its_document(weights_schema: Any) -> None:
    failures = fuzz(weights_schema, WEIGHTS_TOKEN)
    assert not failures, "\n".join(failures)


def test_documents_declare_the_bearer_scheme_and_errors(services: dict[str, str]) -> None:
    for name, token in (("manager", TOKEN), ("weights", WEIGHTS_TOKEN)):
        url = services[name]
        assert httpx.get(f"{url}/openapi.json").status_code == 401  # RLBOOST_EXPOSE=token
        assert httpx.get(f"{url}/metrics").status_code == 401
        doc = httpx.get(f"{url}/openapi.json",
                        headers={"Authorization": f"Bearer {token}"}).json()
        schemes = doc["components"]["securitySchemes"]
        assert all(s == {**s, "type": "http", "scheme": "bearer"} for s in schemes.values())
        for path, ops in doc["paths"].items():
            for method, op in ops.items():
                if path.startswith("/v1/"):
                    assert op["security"] and "401" in op["responses"], (name, method, path)
                assert "413" in op["responses"], (name, method, path)
    doc = httpx.get(f"{services['manager']}/openapi.json",
                    headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert {"404", "422", "503"} <= set(doc["paths"]["/v1/runs/{run_id}"]["get"]["responses"])
    doc = httpx.get(f"{services['weights']}/openapi.json",
                    headers={"Authorization": f"Bearer {WEIGHTS_TOKEN}"}).json()
    put = doc["paths"]["/v1/weights/{run_id}/{version}/files/{name}"]["put"]["responses"]
    assert {"401", "403", "409", "413"} <= set(put)
