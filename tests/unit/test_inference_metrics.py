"""The server's Prometheus text."""

from __future__ import annotations

from asyncrl.inference.api.prometheus import prometheus_text


def test_values_are_written_whole_not_rounded_to_six_digits():
    text = prometheus_text(
        [("generated_tokens_total", "counter", "Tokens.", 123456789), ("kv_cache_usage", "gauge", "Use.", 0.125)]
    )
    assert "asyncrl_inference_generated_tokens_total 123456789\n" in text
    assert "asyncrl_inference_kv_cache_usage 0.125\n" in text
    assert "# TYPE asyncrl_inference_generated_tokens_total counter" in text
