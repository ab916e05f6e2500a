"""The flags every server takes for its metrics and call log (`--metrics-port`, `--metrics-host`,
`--log-format`), defined once for the gRPC servers and the OpenAI front (services.common.metrics)."""

from __future__ import annotations

import argparse
from typing import Any

from memlm.cli.options import port_number


def add_metrics_options(p: argparse.ArgumentParser) -> None:
    from services.common.metrics import LOG_FORMATS, MetricsOptions  # the one home of their defaults

    p.add_argument("--metrics-port", type=port_number, default=MetricsOptions.port, metavar="PORT",
                   help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: any free port, printed "
                        "on stderr; default: not served)")
    p.add_argument("--metrics-host", default=MetricsOptions.host,
                   help="address the metrics endpoint binds (default loopback only)")
    p.add_argument("--log-format", choices=LOG_FORMATS, default=MetricsOptions.log_format,
                   help="json: one JSON line per call on stderr (request_id, tenant, rpc, status, duration_ms)")


def metrics_options(args: argparse.Namespace) -> Any:
    """The services.common.metrics.MetricsOptions the flags of add_metrics_options give."""
    from services.common.metrics import MetricsOptions

    return MetricsOptions(port=args.metrics_port, host=args.metrics_host, log_format=args.log_format)
