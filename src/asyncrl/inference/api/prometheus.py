"""Prometheus text of the inference server's gauges and counters, every name prefixed `asyncrl_inference_`."""

from __future__ import annotations


def prometheus_text(values: list[tuple[str, str, str, float]]) -> str:
    """(name, type, help, value) as Prometheus exposition text. Values are written whole (`repr`): `:g` would
    round a counter past a million to six digits."""
    lines = []
    for name, kind, help_text, value in values:
        metric = f"asyncrl_inference_{name}"
        number = float(value)
        text = str(int(number)) if number.is_integer() and abs(number) < 2**53 else repr(number)
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}", f"{metric} {text}"]
    return "\n".join(lines) + "\n"
