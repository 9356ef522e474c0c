"""BadRequest: a request the edge refuses, with the HTTP status and the parameter to name (OpenAI's shape)."""

from __future__ import annotations


class BadRequest(Exception):
    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
