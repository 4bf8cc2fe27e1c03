"""`llmgw node add`: onboarding over SSH, as a sequence of events, and its screens."""
