"""OpenTelemetry for the trace every request keeps: W3C trace context, spans built from the
request's own event list, OTLP/HTTP export (``docs/observability.md``)."""
