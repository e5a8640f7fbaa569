"""What ``kvbus up`` prints, and how ``services/local_system.py`` reads it back: one place for both,
so a reworded line cannot silently break the tests and benchmarks that start ``kvbus up``.
"""

from __future__ import annotations

import re

SERVING = "Ctrl-C stops everything"
"""Printed last once ready, after every URL (LocalSystem waits for it)."""

_ANNOUNCEMENTS = (
    ("nats", re.compile(r"\[kvbus\] NATS: (nats://\S+)")),
    ("http", re.compile(r"HTTP \(OpenAI API\): (http://\S+)/v1")),
    ("metrics", re.compile(r"\[kvbus\] metrics \(Prometheus\): (\S+) (http://\S+)")),
    ("serving", re.compile(re.escape(f"[kvbus] {SERVING}"))),
)


def say(text: str) -> None:
    print(f"[kvbus] {text}", flush=True)


def say_nats(url: str) -> None:
    say(f"NATS: {url}")


def say_placement(layout: str, layout_why: str, core_sharing: str, num_engines: int,
                  speculation: tuple[str | None, bool] | None) -> None:
    """The choices made for this machine (``speculation`` None: no engine started)."""
    say(f"layout: {layout} ({layout_why})")
    if speculation is not None:
        method, is_greedy_only = speculation
        say("speculative decoding: " + ("off" if method is None else
            f"{method}, greedy requests only (--speculative auto; off: --speculative off)" if is_greedy_only
            else f"{method}, every request"))
    if num_engines > 1:
        say(f"engines on this host: core sharing {core_sharing}")


def say_scrape_config(path: str, num_targets: int) -> None:
    say(f"Prometheus scrape config ({num_targets} targets): {path}  (prometheus --config.file {path})")


def say_ready(*, elapsed_s: float, roles: dict[str, list[str]], served: str, nats_url: str, http_host: str,
              http_port: int, metrics_host: str, metrics_ports: dict[str, int], traces: str = "") -> None:
    """Ready: what was served, and every address to call or scrape."""
    say(f"ready in {elapsed_s:.1f}s: " + ", ".join(f"{len(ids)} {role}" for role, ids in roles.items()))
    say(f"served: {served}")
    if "gateway" in roles:
        say(f"HTTP (OpenAI API): http://{http_host}:{http_port}/v1  (curl http://{http_host}:{http_port}"
            "/v1/chat/completions -H 'Content-Type: application/json' -d '{"
            "\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}')")
        say(f"call over NATS: kvbus call kvbus.v1.generate '{{\"prompt\": \"Once upon a time\"}}' --nats-url {nats_url}")
    else:
        say(f"call it:  kvbus call kvbus.v1.tokenizer.encode '{{\"text\": \"your text\"}}' "
            f"--nats-url {nats_url}")
    for name, port in metrics_ports.items():
        say(f"metrics (Prometheus): {name} http://{metrics_host}:{port}/metrics")
    say(f"traces: {traces or traces_destination(None, None)}")


def traces_destination(trace_file: str | None, endpoint: str | None, sample_ratio: float = 1.0) -> str:
    """Where the services' spans go: the file of kvbus up --trace, an OTLP endpoint, or nowhere."""
    share = f"; {sample_ratio:.0%} of requests" if sample_ratio < 1.0 else ""
    if trace_file is not None:
        return (f"{trace_file} (a local OTLP/HTTP receiver on {endpoint}{share}); "
                "`kvbus trace --last` or `kvbus trace REQUEST_ID` prints a request's waterfall")
    if endpoint:
        return (f"OTLP/HTTP to {endpoint}{share} (Jaeger: `kvbus trace REQUEST_ID --jaeger-url "
                "http://JAEGER:16686` prints one)")
    return ("off (`kvbus up --trace` keeps them in a local file for `kvbus trace`; or set "
            "OTEL_EXPORTER_OTLP_ENDPOINT, e.g. Jaeger's http://127.0.0.1:4318)")


def read_announcement(line: str) -> tuple[str, ...] | None:
    """A line of ``kvbus up``'s output as ``("nats", url)``, ``("http", base_url)``,
    ``("metrics", worker_id, url)`` or ``("serving",)``; None for any other line."""
    for kind, pattern in _ANNOUNCEMENTS:
        if m := pattern.search(line):
            return (kind, *m.groups())
    return None
