"""The admin API client behind `llmgw ctl`."""
