"""Launching: local worker processes under torch's elastic agent (local.py), the node list and
per-node environment (nodes.py), the rendezvous handler (rendezvous.py), multi-node starts
(multinode.py), the launcher's side of stopping on a signal (signals.py) and in-process worlds for
tests (world.py)."""
