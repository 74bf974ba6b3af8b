"""Verifiable rewards: math answers through math-verify, code through a sandbox."""
