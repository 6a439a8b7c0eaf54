"""Workflow control, in one place: what a user asks of a running flow (pause, cancel, resume with mid-run changes) and
how a run keeps its word at an iteration boundary, the events a run emits and the automations that act on them, and
what a deployment may run."""
