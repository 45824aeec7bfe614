#!/usr/bin/env python3
"""A stand-in for llama.cpp's ``llama-server``, for the serving benchmark's smoke test only (the
test suite never builds llama.cpp). It takes llama-server's command line (``-m``, ``--host``,
``--port``, ``--alias``, ``-np``, ``-c``, ``-t``, ``-tb``, and anything else), answers ``GET
/health`` and streams ``POST /v1/completions`` in the shape llama-server's OpenAI route uses: one
``text_completion`` chunk per token (``choices[0].text``, ``logprobs`` null), a last chunk with
``finish_reason`` and ``usage`` (and llama.cpp's ``timings``), then ``data: [DONE]``.

Like the real server, it stops at "EOS" (after one token, ``finish_reason`` "stop") unless the
request says ``ignore_eos``; it generates nothing, it just counts: prompt tokens with the
tokenizer found next to ``-m`` (a model directory), output tokens up to ``max_tokens``.
Connections behave as llama-server's do: HTTP/1.1 with keep-alive, a stream sent in chunks, and
a connection that carried a stream is closed without an answer when its next request arrives (the
real server closes it shortly after the stream, while its headers advertise keep-alive; a pooled
client that sends the next request on it gets no response).

``--record PATH`` (ours) appends its command line and every request body to PATH, one JSON per
line, so the test can check what the benchmark sent.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-m", dest="model", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--alias", default="model")
    parser.add_argument("--record", default=None)
    args, _ = parser.parse_known_args()
    record = Path(args.record) if args.record else None
    if record is not None:
        with record.open("a") as f:
            f.write(json.dumps({"argv": sys.argv[1:]}) + "\n")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        streamed = False  # this connection carried a stream: its next request goes unanswered

        def log_message(self, *_: object) -> None:
            pass

        def do_GET(self) -> None:
            if self._drop_after_stream():
                return
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._json(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

        def _drop_after_stream(self) -> bool:
            if self.streamed:
                self.close_connection = True
            return self.streamed

        def do_POST(self) -> None:
            if self._drop_after_stream():
                return
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if record is not None:
                with record.open("a") as f:
                    f.write(json.dumps({"path": self.path, "body": body}) + "\n")
            if self.path != "/v1/completions" or not body.get("stream"):
                self._json(404, {"error": {"code": 404, "message": "not in the stand-in", "type": "not_found_error"}})
                return
            prompt_tokens = len(tokenizer.encode(body["prompt"], add_special_tokens=False).ids)
            n = int(body.get("max_tokens", 16)) if body.get("ignore_eos") else 1
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Keep-Alive", "timeout=5, max=100")
            self.end_headers()
            self.streamed = True

            def send(raw: bytes) -> None:  # one HTTP chunk
                self.wfile.write(b"%x\r\n%s\r\n" % (len(raw), raw))
                self.wfile.flush()

            cmpl_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"

            def chunk(choice: dict, **extra: object) -> None:
                data = {"choices": [choice], "created": int(time.time()), "model": args.alias,
                        "system_fingerprint": "b0-standin", "object": "text_completion", "id": cmpl_id, **extra}
                send(b"data: " + json.dumps(data).encode() + b"\n\n")

            for _ in range(n):
                chunk({"text": " tok", "index": 0, "logprobs": None, "finish_reason": None})
                time.sleep(0.001)
            usage = {"completion_tokens": n, "prompt_tokens": prompt_tokens, "total_tokens": n + prompt_tokens,
                     "prompt_tokens_details": {"cached_tokens": 0}}
            include_usage = (body.get("stream_options") or {}).get("include_usage")
            chunk({"text": "", "index": 0, "logprobs": None, "finish_reason": "length" if n > 1 else "stop"},
                  **({"usage": usage} if include_usage else {}),
                  timings={"prompt_n": prompt_tokens, "predicted_n": n})
            send(b"data: [DONE]\n\n")
            send(b"")  # the last chunk

        def _json(self, status: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
