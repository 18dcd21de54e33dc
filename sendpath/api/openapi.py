"""Publishing the request schemas in an app's OpenAPI document.

The generation routes read their own body (``api.json_body`` and ``api.schema`` check it,
so every mistake gets OpenAI's error shape), which leaves FastAPI nothing to describe.
``publish_request_schemas`` puts each route's model in as its request body, with the
models it refers to under ``components.schemas``, so the document says what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

__all__ = ["publish_request_schemas"]

_REF = "#/components/schemas/{model}"


def publish_request_schemas(app: FastAPI, bodies: Mapping[str, type[BaseModel]]) -> None:
    """Make ``app.openapi()`` describe ``bodies`` (POST path -> model) as request bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template=_REF)
            components.update(schema.pop("$defs", {}))
            components[model.__name__] = schema
            operation = doc["paths"][path]["post"]
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": _REF.format(model=model.__name__)}}
                },
            }
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)  # FastAPI's own validation error: never sent here
            for code, what in (("400", "Invalid request"), ("413", "Body too large")):
                responses[code] = {"description": what}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
