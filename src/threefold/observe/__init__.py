"""Debugging and reproducibility: flight recorder and hang watchdog, collective fingerprint,
per-rank statistics, non-finite detection, replica checks, traces, plots, parity harness,
deterministic mode. docs/observe.md describes each; the trainer reaches them through
`observer.Observer`, switched on by the config section `debug`."""
