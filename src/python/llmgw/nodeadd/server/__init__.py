"""`llmgw server add`: a machine made a second control plane, as a list of steps over the onboarding toolkit."""
