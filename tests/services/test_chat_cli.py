"""``folio chat``'s own logic, fast: its commands and how it shows a stream (reasoning dimmed,
the answer kept), against a canned SSE reply over a real socket. The whole client against
``folio serve`` in a terminal is ``tests/e2e/test_responses_messages_api.py``."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from folio.cli.chat import DIM, RESET, Chat, build_parser

CHUNKS = [{"choices": [{"delta": {"role": "assistant", "content": ""}}]},
          {"choices": [{"delta": {"reasoning_content": "Two and "}}]},
          {"choices": [{"delta": {"reasoning_content": "two."}}]},
          {"choices": [{"delta": {"content": "It is "}}]},
          {"choices": [{"delta": {"content": "4."}, "finish_reason": "stop"}]}]


class Canned(BaseHTTPRequestHandler):
    bodies: list[dict] = []

    def do_POST(self):
        Canned.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in CHUNKS:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_chat_streams_dims_reasoning_keeps_and_clears_the_conversation(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = Tty()
        chat = Chat(build_parser().parse_args(["--url", f"http://127.0.0.1:{server.server_port}/v1", "--model", "m",
                                               "--max-tokens", "9"]), out)
        chat.command("/system Be brief.")
        chat.ask("2+2?")
        assert out.getvalue().endswith(f"{DIM}Two and two.{RESET}\nIt is 4.\n")
        assert Canned.bodies[-1]["messages"] == [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": "2+2?"}]
        assert Canned.bodies[-1]["stream"] and Canned.bodies[-1]["max_tokens"] == 9
        chat.ask("And 3+3?")  # the conversation goes with it, the answer without its reasoning
        assert [m["content"] for m in Canned.bodies[-1]["messages"]] == ["Be brief.", "2+2?", "It is 4.", "And 3+3?"]
        chat.command(f"/save {tmp_path / 'c.json'}")
        assert len(json.loads((tmp_path / "c.json").read_text())) == 5
        chat.command("/clear")
        chat.command("/nonsense")
        assert "commands: /system" in out.getvalue() and chat.messages() == [{"role": "system", "content": "Be brief."}]
        assert chat.command("/quit") is False
    finally:
        server.shutdown()
