"""Operator commands: the command line, submit/status/cancel/health/dlq, doctor, reconcile, and the
local demo and dev stack."""
