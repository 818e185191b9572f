"""``folio chat``: talk to a model in a terminal, through any OpenAI-compatible server (folio's by
default, at http://127.0.0.1:8000/v1, or ``$OPENAI_BASE_URL``).

Each line goes to ``/chat/completions`` with the conversation so far; the answer streams as it
comes, the model's reasoning (``reasoning_content``) dimmed before it. Commands: ``/system TEXT``
(the system message; empty clears it), ``/clear`` (forget the conversation), ``/save FILE`` (the
conversation as JSON), ``/quit``. Ctrl-C stops an answer; Ctrl-D or ``/quit`` ends.
Standard library only: the client needs nothing the server does not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

DIM, RESET = "\x1b[2m", "\x1b[0m"
HELP = "commands: /system TEXT, /clear, /save FILE, /quit"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="folio chat", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
                        help="the server's OpenAI base URL (default: $OPENAI_BASE_URL or folio's)")
    parser.add_argument("--model", default=None, help="the model to ask (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument("--system", default=None, help="a system message to start with")
    parser.add_argument("--max-tokens", type=int, default=None, help="longest answer, in tokens")
    parser.add_argument("--temperature", type=float, default=None)
    return parser


class Chat:
    """One conversation with one server."""

    def __init__(self, args: argparse.Namespace, out=sys.stdout):
        self.args, self.out = args, out
        self.system: str | None = args.system
        self.turns: list[dict] = []
        self.dim = out.isatty()

    def _request(self, path: str, body: dict | None = None):
        headers = {"Content-Type": "application/json"}
        if self.args.api_key:
            headers["Authorization"] = f"Bearer {self.args.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.args.url.rstrip("/") + path, data=data, headers=headers)
        return urllib.request.urlopen(req, timeout=600)

    def model(self) -> str:
        if self.args.model is None:
            with self._request("/models") as r:
                self.args.model = json.loads(r.read())["data"][0]["id"]
        return self.args.model

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def command(self, line: str) -> bool:
        """A ``/`` command; False when the chat ends."""
        name, _, rest = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/system":
            self.system = rest.strip() or None
            self._say("system message set" if self.system else "system message cleared")
        elif name == "/clear":
            self.turns = []
            self._say("conversation cleared")
        elif name == "/save" and rest.strip():
            with open(rest.strip(), "w") as f:
                json.dump(self.messages(), f, indent=2)
            self._say(f"saved {len(self.messages())} messages to {rest.strip()}")
        else:
            self._say(HELP)
        return True

    def _say(self, text: str) -> None:
        print(f"[{text}]", file=self.out, flush=True)

    def ask(self, text: str) -> None:
        """Send one user turn and stream the answer; the turn is kept with what arrived."""
        self.turns.append({"role": "user", "content": text})
        body = {"model": self.model(), "messages": self.messages(), "stream": True}
        body.update({k: v for k, v in (("max_tokens", self.args.max_tokens),
                                       ("temperature", self.args.temperature)) if v is not None})
        answer, thinking = [], False
        try:
            with self._request("/chat/completions", body) as r:
                for raw in r:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[len("data: "):]).get("choices") or [{}]
                    delta = choices[0].get("delta") or {}
                    reasoning, content = delta.get("reasoning_content"), delta.get("content")
                    if reasoning:
                        self.out.write((DIM if self.dim and not thinking else "") + reasoning)
                        thinking = True
                    if content:
                        if thinking:
                            self.out.write((RESET if self.dim else "") + "\n")
                            thinking = False
                        self.out.write(content)
                        answer.append(content)
                    self.out.flush()
        except KeyboardInterrupt:
            self._say("stopped")
        except urllib.error.HTTPError as exc:
            self.turns.pop()
            self._say(f"error {exc.code}: {exc.read().decode(errors='replace')[:300]}")
            return
        finally:
            self.out.write((RESET if self.dim and thinking else "") + "\n")
            self.out.flush()
        self.turns.append({"role": "assistant", "content": "".join(answer)})


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    chat = Chat(args)
    try:
        print(f"folio chat: {chat.model()} at {args.url} ({HELP})", flush=True)
    except (OSError, ValueError, KeyError, IndexError) as exc:
        print(f"folio chat: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line.startswith("/"):
            if not chat.command(line):
                return 0
            continue
        try:
            chat.ask(line)
        except OSError as exc:
            chat.turns.pop()
            print(f"[cannot reach {args.url}: {exc}]", flush=True)
