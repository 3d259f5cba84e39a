"""API errors in vLLM's shape: `{"error": {"message", "type", "param", "code"}}`.

As in vLLM (and unlike OpenAI, whose `code` is a string identifier), `code` is the HTTP status as an
integer; `type` keeps OpenAI's names (`invalid_request_error`, `not_found_error`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.responses import JSONResponse


@dataclass(slots=True)
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)

    @property
    def outcome(self) -> str:
        """Metric label for this failure."""
        return {400: "bad_request", 404: "not_found", 503: "unavailable"}.get(
            self.status, "error" if self.status >= 500 else "bad_request")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", type="not_found_error",
                    param="model")


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"The engine is not available: {reason}", type="service_unavailable_error")


def internal_error(exc: BaseException) -> APIError:
    return APIError(500, f"internal error: {exc!r}", type="internal_server_error")
