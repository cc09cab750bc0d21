"""`python -m services.health_probe [--identity NAME] HOST:PORT`: `llmmesh health` for probes that run it every few
seconds, such as Kubernetes' exec probes (its own gRPC probes cannot present a certificate, so they cannot reach a
mutual TLS port). It loads gRPC and the mesh's credentials only, not the services `llmmesh` loads (torch): about
60 MiB, against 270 MiB, counted in the limit of the container it runs in."""

import argparse

from engine.config.utils import add_cli_args
from services import config
from services.server import run_health
from services.settings import HealthFlags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.health_probe", description="exit 0 when a service's gRPC health check says SERVING"
    )
    add_cli_args(parser, HealthFlags, grouped=False)
    config.apply_env(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    run_health(build_parser().parse_args(argv))


if __name__ == "__main__":
    main()
