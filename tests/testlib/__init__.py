"""Helpers shared by the test suites: running llmgw as a real process, free ports, fixtures."""
