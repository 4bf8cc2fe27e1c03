"""One module per command group; `llmgw.cli.COMMANDS` lists them."""
