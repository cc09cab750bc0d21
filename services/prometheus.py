"""A Prometheus scrape configuration for a running mesh: one job per service, each at its /metrics address."""


def scrape_config(targets: dict[str, str], scrape_interval: str = "5s") -> str:
    """targets: service name -> HOST:PORT of its /metrics. YAML that Prometheus 2.x and 3.x read."""
    lines = [
        "# Written by `llmmesh serve --metrics-port 0 --prometheus-config FILE`: every service of this mesh.",
        "global:",
        f"  scrape_interval: {scrape_interval}",
        "scrape_configs:",
    ]
    for name, address in targets.items():
        lines += [
            f"  - job_name: {name}",
            "    static_configs:",
            f"      - targets: ['{address}']",
            "        labels:",
            f"          service: {name}",
        ]
    return "\n".join(lines) + "\n"
