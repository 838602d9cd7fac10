#!/usr/bin/python3
"""The spot interruption notice, and nothing else of instance metadata, for the worker containers.

The GPU instances require IMDSv2 with a hop limit of 1, so no container (the worker, or a trainer
stage it runs) can reach 169.254.169.254 and read the instance role's credentials. The worker still
needs the notice EC2 gives two minutes before it reclaims a spot instance (SPOT_INTERRUPTION_CHECK_SECONDS,
worker/core/imds.py). This relay runs on the host, where the hop limit does not apply, and answers
the two requests the worker's watch makes, at IMDS_ENDPOINT (http://172.17.0.1:8119, the docker0
bridge's address on the ECS GPU AMI):

- PUT /latest/api/token: a fixed stand-in token (it opens nothing: the relay serves no other path);
- GET /latest/meta-data/spot/instance-action: the real answer, read with the relay's own IMDSv2
  token (404 until a notice exists, then its JSON);

and 404 to everything else, so /latest/meta-data/iam/security-credentials/ stays out of reach.
The template's UserData installs this file word for word (tests/deploy/test_imds_relay.py checks
that, and runs it against a stand-in metadata service). Python 3 standard library only: the host's
/usr/bin/python3.
"""

import http.client
import http.server
import os
import sys
import threading
import time

UPSTREAM = os.environ.get("RELAY_UPSTREAM", "169.254.169.254:80")
TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
STAND_IN_TOKEN = b"voice-worker-spot-relay"
# Below the worker's own 2 s per request (worker/core/imds.py TIMEOUT_S).
UPSTREAM_TIMEOUT_S = 1.0
TOKEN_TTL_S = 21600
MAX_BODY = 64 * 1024

_token = {"value": None, "until": 0.0}
_lock = threading.Lock()


def _upstream(method, path, headers):
    host, _, port = UPSTREAM.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=UPSTREAM_TIMEOUT_S)
    try:
        connection.request(method, path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(MAX_BODY)
    finally:
        connection.close()


def _imds_token():
    with _lock:
        if _token["value"] is None or time.monotonic() >= _token["until"]:
            status, body = _upstream("PUT", TOKEN_PATH,
                                     {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_S)})
            if status != 200:
                raise OSError(f"HTTP {status} for an IMDSv2 token")
            _token["value"] = body.decode("ascii").strip()
            _token["until"] = time.monotonic() + TOKEN_TTL_S - 60
        return _token["value"]


class Relay(http.server.BaseHTTPRequestHandler):
    server_version = "voice-worker-spot-relay"

    def do_PUT(self):  # noqa: N802 - http.server's naming
        if self.path == TOKEN_PATH:
            self._answer(200, STAND_IN_TOKEN)
        else:
            self._answer(404, b"")

    def do_GET(self):  # noqa: N802
        if self.path != NOTICE_PATH:
            self._answer(404, b"")
            return
        try:
            status, body = _upstream("GET", NOTICE_PATH, {"X-aws-ec2-metadata-token": _imds_token()})
            if status == 401:  # IMDS restarted and forgot the token: one fresh try
                with _lock:
                    _token["value"] = None
                status, body = _upstream("GET", NOTICE_PATH, {"X-aws-ec2-metadata-token": _imds_token()})
        except (OSError, http.client.HTTPException, ValueError):
            status, body = 502, b""
        self._answer(status if status in (200, 404) else 502, body if status == 200 else b"")

    def do_POST(self):  # noqa: N802
        self._answer(404, b"")

    do_DELETE = do_PATCH = do_HEAD = do_POST

    def _answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - quiet: the worker logs what it sees
        pass


def main(argv):
    host, _, port = (argv[1] if len(argv) > 1 else "172.17.0.1:8119").rpartition(":")
    server = http.server.ThreadingHTTPServer((host, int(port)), Relay)
    print(f"spot relay on {host}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv)
