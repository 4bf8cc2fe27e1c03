"""`llmgw server add`: node add's machinery (SSH, the release, the checklist) installing a second control plane."""
