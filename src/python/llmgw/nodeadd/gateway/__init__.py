"""`llmgw gateway add`: a machine made a gateway, as a list of steps over the onboarding toolkit."""
