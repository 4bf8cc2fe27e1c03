"""`llmgw node add`: a machine made a node, as a list of steps over the onboarding toolkit."""
