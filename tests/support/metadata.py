"""A local stand-in for the AWS and GCP metadata servers' preemption notices.

Serves what ``rollout_svc.notice`` polls, per the providers' docs; ``preempted`` flips the
answer. Started in a thread of the test process by the ``metadata`` fixture (tests/conftest.py).
"""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Metadata(ThreadingHTTPServer):
    """AWS IMDSv2 (token + spot/instance-action) and GCP (instance/preempted), per their docs."""

    preempted = False
    token = "tok-123"
    token_requests = 0


class Handler(BaseHTTPRequestHandler):
    server: Metadata

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, code: int, body: str = "") -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        if self.path == "/latest/api/token" and \
                self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self.server.token_requests += 1
            self._send(200, self.server.token)
        else:
            self._send(400)

    def do_GET(self) -> None:
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != self.server.token:
                self._send(401)
            elif self.server.preempted:
                self._send(200, '{"action": "terminate", "time": "2026-11-29T10:00:00Z"}')
            else:
                self._send(404)
        elif self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                self._send(403)
            else:
                self._send(200, "TRUE" if self.server.preempted else "FALSE")
        else:
            self._send(404)
