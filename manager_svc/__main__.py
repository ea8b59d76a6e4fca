"""``python -m manager_svc``: read config, set up logging, serve REST + bus until SIGTERM."""

from __future__ import annotations

import gc
import logging
from urllib.parse import urlparse

import uvicorn

from manager_svc.app import create_app
from manager_svc.service import ManagerService
from shared.config import ManagerConfig, url_port
from shared.http_guard import LOOPBACK, refuse_open_bind, refuse_plain_bind
from shared.logs import setup_logging
from shared.process import die_with_parent

GC_THRESHOLDS = (50_000, 20, 10)  # young allocations, then collections per older generation


def main() -> None:
    die_with_parent()
    cfg = ManagerConfig.from_env()
    setup_logging(cfg.common.log_level, "manager")
    host = urlparse(cfg.common.manager_url).hostname or "127.0.0.1"
    bind = host if host in LOOPBACK else "0.0.0.0"
    refuse_open_bind("manager", bind, cfg.common.api_token, "RLBOOST_API_TOKEN")
    tls = cfg.common.tls
    refuse_plain_bind("manager", bind, tls.serving, cfg.common.allow_plaintext)
    app = create_app(ManagerService(cfg), bind_host=bind)
    # What is made so far (modules, the app, its routes and models) lives as long as the
    # process: frozen, the collector stops scanning it, and a full collection inside an
    # assignment or a barrier no longer stalls the loop for long.
    gc.collect()
    gc.freeze()
    # Ingest makes a few tracked objects per frame entry (the entry, its id list), so at the
    # default 700 a young collection ran every ~100 entries: ~12 % of the manager's CPU in a
    # drained step of bench-control-plane (0.49 -> 0.43 s). Nothing ingest makes is cyclic;
    # what is, is still collected, every 50k allocations instead.
    gc.set_threshold(*GC_THRESHOLDS)
    uvicorn.run(app, host=bind, port=url_port(cfg.common.manager_url, 8000),
                log_level=logging.getLevelName(logging.WARNING).lower(), access_log=False,
                # An open dashboard's event stream must not hold the manager's stop.
                timeout_graceful_shutdown=3,
                ssl_certfile=tls.cert_file, ssl_keyfile=tls.key_file)


if __name__ == "__main__":
    main()
