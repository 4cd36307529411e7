"""Errors as OpenAI's API returns them: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}

_DEFAULT_TYPE = {4: "invalid_request_error", 5: "internal_server_error"}


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, _DEFAULT_TYPE[self.status // 100]),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_validation_error(exc: RequestValidationError) -> APIError:
    """One 400 for a body that does not parse or validate, naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError("the request body is invalid")
    first = errors[0]
    # Drop "body" and the union member tags pydantic adds ("str", "list[str]").
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    if first.get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {first.get('msg')}")
    if first.get("type") == "extra_forbidden":
        return APIError(
            f"unknown field `{'.'.join(loc)}`; it is neither an OpenAI nor a Pagoda parameter",
            param=".".join(loc) or None,
        )
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    where = ".".join(loc)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    if where and f"`{where}`" not in msg:
        msg = f"{where}: {msg}"
    return APIError(msg + more, param=where or None)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (
        "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none")
    )
