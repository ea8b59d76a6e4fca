"""The weight-transfer library: how a checkpoint version travels between services.

The public API below is what trainers, rollout instances and benchmarks import; the weight
service imports the wire format from :mod:`shared.weights.manifest` and its data plane from
:mod:`shared.weights.range_server` directly, so it never depends on the client side.

One module per noun, in the order a pull uses them:

- ``manifest``      the wire format both ends share: manifest types, name rules, checks
- ``session``       the HTTP session every API call goes through, with its retry policy
- ``client``        upload (whole or in parts), wait for, pin and unpin a version; list its
                    peers and a run's versions
- ``pull``          pulling one version: sources, worker threads, resume, publish
- ``plan``          the chunk schedule of one pull (which chunk from which source, when)
- ``delta``         a version as its compressed XOR against the version before: build, apply
- ``adapter``       an adapter-only version merged into its base (torch: imported by the
                    engines and export that need it, never from here)
- ``partial``       a version being pulled: its directory and verified-chunk record
- ``fetch``         moving one chunk: a blocking range client that verifies as it streams
- ``peer``          a rollout instance serving its verified chunks to other instances
- ``range_server``  a threaded ``sendfile`` server of checkpoint byte ranges (service and peers)
"""

from shared.weights.client import (
    commit_version,
    list_peers,
    list_versions,
    model_files,
    pin_version,
    published,
    unpin_version,
    upload_adapter_version,
    upload_files,
    upload_version,
    wait_for_version,
)
from shared.weights.manifest import (
    MANIFEST_NAME,
    MAX_VERSION,
    ChunkEntry,
    FileEntry,
    Manifest,
    valid_name,
    valid_run_id,
    valid_version,
)
from shared.weights.peer import PeerServer
from shared.weights.pull import CHUNK_TRIES, PullStats, pull_version

__all__ = [
    "CHUNK_TRIES",
    "MANIFEST_NAME",
    "MAX_VERSION",
    "ChunkEntry",
    "FileEntry",
    "Manifest",
    "PeerServer",
    "PullStats",
    "commit_version",
    "list_peers",
    "list_versions",
    "model_files",
    "pin_version",
    "published",
    "pull_version",
    "unpin_version",
    "upload_adapter_version",
    "upload_files",
    "upload_version",
    "valid_name",
    "valid_run_id",
    "valid_version",
    "wait_for_version",
]
