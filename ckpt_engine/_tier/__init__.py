"""The node-local tier's mechanisms: which ranks share a node and hold whose replicas, what each
rank holds on its node, files sent between ranks checksummed, replication after each save, and
the recovery planner of a resume.

The engine (``_engine``) decides when a save goes to the local tier and reads what recovery
restored; this package never imports it.
"""
