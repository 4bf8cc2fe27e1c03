"""`llmgw gateway add`: node add's machinery (SSH, the release, the checklist) installing a gateway."""
