"""Metrics sinks, plots and run summaries."""
