"""``python -m weight_svc``: read WeightsConfig from the environment, log it once, serve.

The service listens on the port of RLBOOST_WEIGHTS_URL (default 8001), and serves downloads fast
on a second port (RLBOOST_WEIGHTS_DATA_PORT, default any free one; see weight_svc.peers). It binds
the URL's host when that is an IP address (a loopback URL must not expose the store to the
network) and all interfaces when it is a DNS name, which in a container or cluster names this
machine from outside.
SIGTERM and SIGINT stop it gracefully: uvicorn stops accepting, drains requests for a bounded
time, then the lifespan closes the NATS connection.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from shared.config import WeightsConfig, url_port
from shared.http_guard import refuse_open_bind, refuse_plain_bind
from shared.logs import setup_logging
from shared.process import die_with_parent
from weight_svc.app import create_app
from weight_svc.peers import bind_host

log = logging.getLogger("weight_svc")

DEFAULT_PORT = 8001
GRACEFUL_SHUTDOWN_S = 10  # long downloads are cut after this; clients resume by range


def main() -> None:
    die_with_parent()
    cfg = WeightsConfig.from_env()
    setup_logging(cfg.common.log_level, "weights")
    host, port = bind_host(cfg.common.weights_url), url_port(cfg.common.weights_url, DEFAULT_PORT)
    # Without the write token, anyone who reaches it could publish a version.
    refuse_open_bind("weight service", host, cfg.common.weights_token, "RLBOOST_WEIGHTS_TOKEN")
    tls = cfg.common.tls
    refuse_plain_bind("weight service", host, tls.serving, cfg.common.allow_plaintext)
    log.info("weight service config: %s listen=%s:%d", cfg.describe(), host, port)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(cfg),
            host=host,
            port=port,
            log_config=None,  # keep the root logging set up above
            access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            ssl_certfile=tls.cert_file,
            ssl_keyfile=tls.key_file,
        )
    )
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown, then re-raises the signal under the
    # handlers it found; with this one in place a graceful stop exits 0 rather than -SIGTERM.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    server.run()
    log.info("weight service stopped")


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    main()
