"""Prometheus /metrics for a service: its registry served on a port of its own, and its plain counters exported."""

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer


class DictCounters:
    """A collector of a service's own cumulative counters: a dict, read at each scrape."""

    def __init__(self, prefix: str, counters: dict):
        self.prefix, self.counters = prefix, counters

    def describe(self):
        return []

    def collect(self):
        for name, value in self.counters.items():
            yield CounterMetricFamily(
                f"{self.prefix}{name}", f"{self.prefix}{name} since the service started", value=value
            )


def metrics_app(registry):
    """prometheus_client's /metrics app for the registry, with our names (vllm:*, llmmesh:*) kept for every scraper.

    The library's OpenMetrics encoder escapes sample names with the label-name characters, which lack the colon,
    unless the scraper allows UTF-8 names (https://github.com/prometheus/client_python/issues/1177): Prometheus 2.x,
    which asks for OpenMetrics without an `escaping` parameter, would store vllm_prompt_tokens_total. The classic
    text encoder keeps every legal metric name, colons included, and every Prometheus reads it. So the library's
    negotiation is offered OpenMetrics only when the scraper allows UTF-8 names (Prometheus 3.x by default)."""
    app = make_wsgi_app(registry)

    def metrics(environ, start_response):
        offers = environ.get("HTTP_ACCEPT", "").split(",")
        environ["HTTP_ACCEPT"] = ",".join(offer for offer in offers if _offer_keeps_names(offer))
        return app(environ, start_response)

    return metrics


def _offer_keeps_names(offer: str) -> bool:
    media_type, *parameters = (part.strip() for part in offer.split(";"))
    return media_type != "application/openmetrics-text" or "escaping=allow-utf-8" in parameters


class _MetricsServer(ThreadingWSGIServer):
    """prometheus_client's threaded WSGI server, on IPv4 or IPv6 as its host is."""

    def __init__(self, address, handler):
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0]
        super().__init__(address, handler)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # no log line per scrape
        pass


def serve_metrics(registry, host: str, port: int) -> _MetricsServer:
    """The registry's /metrics on host:port (0: a free port), served by a daemon thread until shutdown()."""
    server = make_server(host, port, metrics_app(registry), _MetricsServer, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
