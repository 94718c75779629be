"""An OpenAI-compatible chat-completions server on 127.0.0.1, in a thread, for driving a real
agent without a network: it records every request it receives and answers each chat
completion with what a test's ``reply`` function says, as one JSON body or, when the request
asks for ``stream: true``, as server-sent events (one chunk per piece, then ``[DONE]``).

    with StubOpenAI(lambda body: Reply(content="hi")) as stub:
        client = OpenAI(base_url=stub.base_url, api_key="dummy")
        ...
    stub.chat_requests()   # the request bodies, in arrival order

Any other path answers 404 (and is recorded too), so a client's probes fail fast and show up
in the record instead of being answered by accident. When ``reply`` raises, the request is
answered 400 (a client does not retry it) and the exception is kept in ``errors``.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CHAT_PATH = "/v1/chat/completions"
CREATED = 1_700_000_000  # a fixed timestamp: answers are byte-for-byte reproducible
# The usage every answer reports: small, constant, and enough for a client's accounting.
USAGE = {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One function call the assistant asks for; ``arguments`` is sent as a JSON string."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True, slots=True)
class Reply:
    """The assistant message one chat completion answers with."""

    content: str | None = None
    tool_calls: Sequence[ToolCall] = field(default_factory=tuple)


@dataclass(frozen=True, slots=True)
class Request:
    """One HTTP request the server received; ``body`` is the parsed JSON (None if none)."""

    method: str
    path: str
    body: Any


class StubOpenAI:
    """The server. ``reply(body)`` is called, on the server's request thread, with each chat
    completion request's parsed body, and returns the assistant message to answer with."""

    def __init__(self, reply: Callable[[dict[str, Any]], Reply], *,
                 model: str = "stub-model") -> None:
        self._reply = reply
        self._model = model
        self._requests: list[Request] = []
        self._lock = threading.Lock()
        self.errors: list[Exception] = []
        self._ids = itertools.count(1)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="stub-openai", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StubOpenAI:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- what was received ---------------------------------------------------------------

    @property
    def requests(self) -> list[Request]:
        """Every request received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._requests)

    def chat_requests(self) -> list[dict[str, Any]]:
        """The bodies of the chat completion requests received so far, in arrival order."""
        return [r.body for r in self.requests if r.path == CHAT_PATH and r.method == "POST"]

    # -- serving -------------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)

    def _completion(self, body: dict[str, Any]) -> tuple[Reply, str]:
        reply = self._reply(body)
        calls = tuple(c if c.id else ToolCall(c.name, c.arguments, f"call_{next(self._ids)}")
                      for c in reply.tool_calls)
        return Reply(reply.content, calls), f"chatcmpl-{next(self._ids)}"

    def _message(self, reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [_call_json(c) for c in reply.tool_calls]
        return message

    def _chunks(self, reply: Reply, completion_id: str, usage: bool) -> Iterator[dict[str, Any]]:
        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {"id": completion_id, "object": "chat.completion.chunk", "created": CREATED,
                    "model": self._model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        if reply.content:
            yield chunk({"content": reply.content})
        for index, call in enumerate(reply.tool_calls):
            yield chunk({"tool_calls": [{"index": index, **_call_json(call)}]})
        yield chunk({}, "tool_calls" if reply.tool_calls else "stop")
        if usage:
            yield {"id": completion_id, "object": "chat.completion.chunk", "created": CREATED,
                   "model": self._model, "choices": [], "usage": USAGE}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            # HTTP/1.0: every answer ends with the connection, so a stream needs no framing.
            protocol_version = "HTTP/1.0"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # the record is the log

            def do_GET(self) -> None:
                stub._record(Request("GET", self.path, None))
                self._json(404, {"error": {"message": f"no {self.path} here",
                                           "type": "not_found"}})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                stub._record(Request("POST", self.path, body))
                if self.path != CHAT_PATH or not isinstance(body, dict):
                    self._json(404, {"error": {"message": f"no {self.path} here",
                                               "type": "not_found"}})
                    return
                try:
                    reply, completion_id = stub._completion(body)
                except Exception as exc:  # the script's fault: shown to the client and kept
                    stub.errors.append(exc)
                    self._json(400, {"error": {"message": f"stub reply failed: {exc!r}",
                                               "type": "invalid_request_error"}})
                    return
                if body.get("stream"):
                    usage = bool((body.get("stream_options") or {}).get("include_usage"))
                    self._stream(stub._chunks(reply, completion_id, usage))
                    return
                self._json(200, {
                    "id": completion_id, "object": "chat.completion", "created": CREATED,
                    "model": stub._model,
                    "choices": [{"index": 0, "message": stub._message(reply),
                                 "finish_reason": "tool_calls" if reply.tool_calls else "stop"}],
                    "usage": USAGE,
                })

            def _json(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _stream(self, chunks: Iterator[dict[str, Any]]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                for chunk in chunks:
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

        return Handler


def _call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
